"""Communication backends behind one small interface (`Communicator`)."""

from .base import CallbackWork, Communicator, DoneWork, ReduceOp, Work
from .local import LocalCommunicator

__all__ = ["CallbackWork", "Communicator", "DoneWork", "LocalCommunicator", "ReduceOp", "Work"]
