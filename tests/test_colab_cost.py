"""The Colab T4 estimate of every lab at ``gpu`` (benchmarks/colab_cost.py): recomputed from
the current labs and profiles, equal to the committed table, and within 10 minutes a lab."""

import math

import pytest

from benchmarks import colab_cost
from lsdl_lab.profiles import PROFILES


@pytest.fixture(scope="module")
def works():
    return colab_cost.estimate()


def test_committed_table_is_the_current_estimate(works):
    # A lab or a profile whose gpu sizes changed changes the estimate: rerun
    # `python -m benchmarks.colab_cost` and commit benchmarks/results/colab_cost.md.
    assert colab_cost.RESULT.read_text() == colab_cost.report(works)


def test_every_lab_fits_ten_minutes_of_a_t4(works):
    totals = {lab: sum(w.seconds for w in items) for lab, items in works.items()}
    over = {lab: round(s / 60, 1) for lab, s in totals.items() if s > colab_cost.LIMIT_S}
    assert not over, f"minutes at gpu on a Colab T4 above 10: {over}"


def test_every_lab_is_costed_or_says_why_not():
    labs = {p.stem.split("_")[0] for p in colab_cost.LABS.glob("lab*.ipynb")}
    assert labs == set(colab_cost.COSTED) | set(colab_cost.NOT_COSTED)
    assert not set(colab_cost.COSTED) & set(colab_cost.NOT_COSTED)


def test_counted_flops_agree_with_the_rules_of_thumb():
    resnet_train = colab_cost.flops_per_example("resnet", True)
    resnet_forward = colab_cost.flops_per_example("resnet", False)
    # A backward pass costs about twice the forward (gradients of inputs and of weights).
    assert 2.8 < resnet_train / resnet_forward < 3.2
    # ResNet-20 (He et al., 2016): about 41 million multiply-adds per 32x32 image.
    assert 0.075e9 < resnet_forward < 0.09e9
    # A transformer's training step: about 6 x parameters x tokens, plus attention.
    gpt = colab_cost._model("gpt")
    six_nt = 6 * sum(p.numel() for p in gpt.parameters()) * PROFILES["gpu"].block_size
    assert 1.0 < colab_cost.flops_per_example("gpt", True) / six_nt < 1.25


def test_sizes_are_read_from_the_labs():
    assert colab_cost.gpu_pick("lab03", "gpt_steps") == PROFILES["gpu"].pick(
        smoke=None, cpu=None, gpu=colab_cost.gpu_pick("lab03", "gpt_steps")
    )
    # `gpu=P.resnet_depth` is evaluated with the gpu profile as P
    assert colab_cost.gpu_pick("lab05", "depth") == PROFILES["gpu"].resnet_depth
    assert colab_cost.dict_len("lab03", "OPTIMIZERS") == 10
    with pytest.raises(LookupError, match="no assignment `nothing_here"):
        colab_cost.gpu_pick("lab03", "nothing_here")


def test_seconds_follow_the_stated_throughput():
    work = colab_cost.Work("one epoch", "resnet", 50_000, 390)
    flops = 50_000 * colab_cost.flops_per_example("resnet", True)
    rate = colab_cost.T4_PEAK["fp32"] * colab_cost.EFFICIENCY["resnet"]
    assert math.isclose(work.seconds, flops / rate + 390 * colab_cost.STEP_OVERHEAD_S)
    on_cpu = colab_cost.Work("one epoch", "resnet", 50_000, cpu=True)
    assert math.isclose(on_cpu.seconds, flops / colab_cost.CPU_FLOPS)
