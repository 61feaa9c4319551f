"""Expert parallelism on real gloo worlds of 2 and 4 ranks, float64: the layer equals the
one-process MoE forward and backward on each rank's tokens (output, input gradient,
aux loss, router gradient, every expert's gradient on its owning rank), routes and drops
the same tokens, and hands its all-to-alls the bytes the routing counts predict. One
spawned world per world size, every check inside it (expert_workers.py)."""

import expert_workers
import pytest

from lsdl_lab.distributed import spawn

FLOAT64 = 1e-12
WORLDS = (2, 4)
CASES = tuple(expert_workers.CASES)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda p: f"world{p}")
def reports(request):
    return spawn(expert_workers.expert_parallel_report, request.param, backend="gloo", timeout=60)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_equal_the_one_process_layer(reports, case):
    for rank, report in enumerate(reports):
        r = report[case]
        errors = {k: v for k, v in r.items() if k.startswith("expert ")}
        experts, _, _, _ = expert_workers.CASES[case]
        assert len(errors) == 4 * experts // len(reports)  # 4 tensors per local expert
        errors |= {k: r[k] for k in ("output", "input_grad", "aux", "router_grad")}
        for name, error in errors.items():
            assert error < FLOAT64, f"{case} {name} on rank {rank}: error {error:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_routes_and_drops_as_the_one_process_layer(reports, case):
    for rank, report in enumerate(reports):
        assert report[case]["same_stats"], f"{case}: tokens per expert differ on rank {rank}"
    # the capacity cut is exercised: some assignments are dropped in every case
    assert sum(report[case]["dropped"] for report in reports) > 0


def test_each_rank_holds_its_share_of_the_experts(reports):
    p = len(reports)
    for case, (experts, *_) in expert_workers.CASES.items():
        assert all(report[case]["local_experts"] == experts // p for report in reports)


@pytest.mark.parametrize("case", CASES)
def test_rows_and_bytes_follow_the_routing_counts(reports, case):
    for rank, report in enumerate(reports):
        r = report[case]
        assert r["sent"] == r["sent_expected"], f"rank {rank}"
        assert r["received"] == r["received_expected"], f"rank {rank}"
        assert r["bytes_forward"] == r["bytes_forward_formula"], f"rank {rank}"
        assert r["bytes_backward"] == r["bytes_backward_formula"], f"rank {rank}"
        assert r["wire_bytes"] == r["wire_formula"], f"rank {rank}"
        assert r["bytes_backward"] > 0
    # rows sent from s to j are the rows j receives from s
    p = len(reports)
    for s in range(p):
        for j in range(p):
            assert reports[s][case]["sent"][j] == reports[j][case]["received"][s]


def test_uneven_and_empty_splits_are_exercised(reports):
    # the equal-logits router sends no token of any rank to some rank's experts
    assert any(0 in report["skewed"]["sent"] for report in reports)
    assert len({tuple(report["top2"]["sent"]) for report in reports}) > 1


def test_no_built_in_collective_is_used(reports):
    # the steps ran inside SentMessages(forbid=True), which raises on one (checked here)
    assert all(report["forbid_works"] for report in reports)


def test_expert_parallel_gpt_equals_the_moe_gpt(reports):
    for rank, report in enumerate(reports):
        for name, error in report["gpt"].items():
            assert error < FLOAT64, f"gpt {name} on rank {rank}: error {error:.2e}"


def test_bad_splits_are_refused(reports):
    p = len(reports)
    refusals = reports[0]["refusals"]
    assert refusals["experts"] == (
        "ValueError",
        f"Invalid experts: 5 (expected a multiple of the group's {p} ranks: each holds "
        "experts / ranks of them)",
    )
    assert refusals["moe"] == ("TypeError", "Invalid moe: a Linear (expected an MoE)")
    assert refusals["dense"][0] == "ValueError" and "moe_experts > 0" in refusals["dense"][1]
