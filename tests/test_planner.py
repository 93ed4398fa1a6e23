"""Bucket planning: contiguity in the given order, thresholds, dtype boundaries, padding."""

import pytest
import torch

from dear.fusion.planner import plan_buckets


def params(*specs):
    return [torch.zeros(n, dtype=dt) for n, dt in specs]


def test_threshold_groups_contiguously_in_order():
    ps = params((10, torch.float32), (10, torch.float32), (10, torch.float32), (30, torch.float32))
    specs = plan_buckets(ps, [3, 0, 1, 2], threshold_bytes=80, world_size=1)
    assert [s.params for s in specs] == [(3,), (0, 1), (2,)]
    assert specs[1].offsets == (0, 10) and specs[1].flags_offset == 20


def test_zero_threshold_is_one_bucket_per_parameter_and_huge_is_one():
    ps = params(*[(5, torch.float32)] * 4)
    assert len(plan_buckets(ps, range(4), 0, 1)) == 4
    assert len(plan_buckets(ps, list(range(4)), 1 << 30, 1)) == 1


def test_tied_parameters_share_a_bucket():
    ps = params(*[(10, torch.float32)] * 5)
    # threshold 0: one bucket per parameter, except a tie (dear.KFAC's weight and bias), which
    # is placed where its first member comes in the order, even when the members are apart
    specs = plan_buckets(ps, [0, 1, 2, 3, 4], 0, 1, tied=[[1, 2], [4, 0]])
    assert [s.params for s in specs] == [(0, 4), (1, 2), (3,)]
    # a tie may overshoot the threshold rather than be split
    specs = plan_buckets(ps, [0, 1, 2, 3, 4], 80, 1, tied=[[1, 2]])
    assert [s.params for s in specs] == [(0,), (1, 2), (3, 4)]
    # explicit groups win over ties
    specs = plan_buckets(ps, [0, 1, 2, 3, 4], 0, 1, [[2, 3]], tied=[[1, 2]])
    assert [s.params for s in specs] == [(0,), (1,), (2, 3), (4,)]


def test_dtypes_never_mix():
    ps = params((4, torch.float32), (4, torch.float16), (4, torch.float16), (4, torch.float32))
    specs = plan_buckets(ps, list(range(4)), 1 << 30, 1)
    assert [s.params for s in specs] == [(0,), (1, 2), (3,)]
    assert [s.dtype for s in specs] == [torch.float32, torch.float16, torch.float32]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_padding_gives_equal_shards(world):
    ps = params((11, torch.float32), (6, torch.float32))
    (spec,) = plan_buckets(ps, [0, 1], 1 << 30, world)
    assert spec.padded_numel % world == 0
    assert spec.padded_numel >= 11 + 6 + 2          # gradients + one usage flag each
    assert spec.padded_numel - world < 19
    assert spec.shard_numel * world == spec.padded_numel


def test_first_bucket_follows_an_oversize_leading_parameter():
    """BERT's word embedding (89 MB) leads forward order and gets a bucket of its own; the
    parameters after it (position embeddings, the first layer) are also ready last in backward
    and needed first in forward, so they, not the embedding, get the small first bucket, and
    that bucket is all-gathered alone."""
    from dear.fusion.fusion_config import FusionConfig
    from dear.fusion.layout import plan_layout
    from dear.fusion.planner import first_bucket_index
    ps = params((1000, torch.float32), (10, torch.float32), (10, torch.float32),
                (30, torch.float32), (30, torch.float32), (30, torch.float32))
    specs = plan_buckets(ps, range(6), 400, 1, first_bucket_bytes=80)
    assert [s.params for s in specs] == [(0,), (1, 2), (3, 4, 5)]
    assert first_bucket_index(specs, 400, 80) == 1
    specs, groups = plan_layout(ps, range(6), FusionConfig(400, 10_000, 80), 1)
    assert groups == [[0], [1], [2]]
    assert plan_layout(ps, range(6), FusionConfig(400, 10_000, None), 1)[1] == [[0, 1, 2]]
    # no oversize lead: the first bucket is bucket 0, as before
    specs = plan_buckets(ps, [1, 2, 0, 3, 4, 5], 400, 1, first_bucket_bytes=80)
    assert [s.params for s in specs] == [(1, 2), (0,), (3, 4, 5)]
    assert first_bucket_index(specs, 400, 80) == 0
    # first bucket 0 bytes (one parameter): an oversize lead is still skipped, and the rest
    # keeps the threshold
    specs = plan_buckets(ps, range(6), 400, 1, first_bucket_bytes=0)
    assert [s.params for s in specs] == [(0,), (1,), (2, 3, 4, 5)]


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets(params((1, torch.float32)) * 2, [0, 0], 10, 1)


def test_explicit_groups_are_buckets_at_their_first_member():
    ps = params(*[(4, torch.float32)] * 5)
    specs = plan_buckets(ps, [0, 1, 2, 3, 4], 1 << 30, 1, explicit=[[3, 1]])
    assert [s.params for s in specs] == [(0,), (1, 3), (2, 4)]


def test_explicit_group_mixing_dtypes_is_refused():
    ps = params((4, torch.float32), (4, torch.float16))
    with pytest.raises(ValueError, match="mixes dtypes"):
        plan_buckets(ps, [0, 1], 10, 1, explicit=[[0, 1]])


def test_default_threshold_keeps_about_eight_buckets_on_a_small_model(monkeypatch):
    """No threshold given: 25 MB, or an eighth of the gradient (at least 1 MB); an argument or
    DEAR_FUSION_THRESHOLD wins."""
    import dear
    from dear.config import auto_threshold
    MB = 1 << 20
    assert auto_threshold(400 * MB) == 25 * MB
    assert auto_threshold(48 * MB) == 6 * MB
    assert auto_threshold(2 * MB) == MB
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(16)])
    monkeypatch.delenv("DEAR_FUSION_THRESHOLD", raising=False)
    dear.init()
    try:
        sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
        opt = dear.DistributedOptimizer(sgd(), model=model)
        assert opt.dear_engine.fusion.rs_threshold == 2 * MB            # 16 MB of gradient / 8
        assert dear.DistributedOptimizer(sgd(), model=model, fusion_threshold=5 * MB
                                         ).dear_engine.fusion.rs_threshold == 5 * MB
        dear.shutdown()
        monkeypatch.setenv("DEAR_FUSION_THRESHOLD", "3MB")
        dear.init()
        opt = dear.DistributedOptimizer(sgd(), model=model)
        assert opt.dear_engine.fusion.rs_threshold == 3 * MB
    finally:
        dear.shutdown()


def test_plan_slack_is_read_and_checked():
    from dear.config import Config
    assert Config.from_env({}).plan_slack == 0.1
    assert Config.from_env({"DEAR_PLAN_SLACK": "0.25"}).plan_slack == 0.25
    with pytest.raises(ValueError, match="plan_slack must be in"):
        Config.from_env({"DEAR_PLAN_SLACK": "1.5"})
