"""The live-bytes counter (``attention/reference/memory.py``): what it counts as alive, by
storage, and when it counts it freed."""

from __future__ import annotations

import torch

from megatron_hcp.attention.reference.memory import LiveBytes, StepMemory, measure_step

F32 = 4


def test_an_allocation_counts_its_bytes_and_a_freed_tensor_none():
    with LiveBytes() as mem:
        x = torch.empty(1000)
        assert mem.current == 1000 * F32
        y = x + 1
        assert mem.current == 2000 * F32
        del y
        assert mem.current == 1000 * F32
        del x
        assert mem.current == 0
    assert mem.peak == 2000 * F32


def test_views_count_once_and_keep_their_storage_alive():
    with LiveBytes() as mem:
        x = torch.zeros(10, 100)
        views = [x.t(), x[2:5], x.view(1000), x.unsqueeze(0).expand(3, 10, 100), x.permute(1, 0)]
        assert mem.current == 1000 * F32  # one storage, however many views
        del x
        assert mem.current == 1000 * F32  # the views hold it
        del views
        assert mem.current == 0


def test_in_place_ops_create_nothing_and_out_ops_count_their_resize():
    with LiveBytes() as mem:
        x = torch.ones(100)
        x.add_(1).mul_(3)
        x[10:20].zero_()
        torch.add(x, 1, out=x)
        assert mem.current == 100 * F32
        out = torch.empty(0)
        torch.add(x, 1, out=out)  # resized by the op: counted at its new size
        assert mem.current == 200 * F32
        out.untyped_storage().resize_(0)  # outside the dispatcher: seen at the next read
        assert mem.current == 100 * F32
    assert mem.peak == 200 * F32


def test_tensors_made_before_the_counter_are_not_counted_but_results_from_them_are():
    before = torch.randn(50)
    with LiveBytes() as mem:
        view = before[:10]
        assert mem.current == 0
        copy = before.clone()
        assert mem.current == 50 * F32
        literal = torch.tensor([1.0, 2.0, 3.0])  # lift_fresh hands on a storage made outside
        assert mem.current == 53 * F32
    del view, copy, literal


def test_tensors_autograd_saves_stay_alive_until_backward_frees_them():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveBytes() as mem:
        x = w.clone()  # a tensor of the graph: 64 * 64
        y = torch.sigmoid(x)  # sigmoid saves its output
        z = (y * x).sum()  # mul saves both of its inputs
        del x, y
        kept = mem.mark("forward")
        assert kept == 2 * 64 * 64 * F32 + F32  # x and y saved, z alive
        z.backward()
        del z
        after = mem.mark("backward")
        assert after == 64 * 64 * F32  # w.grad only: the graph freed what it saved
    assert mem.marks == {"forward": kept, "backward": after}
    assert mem.peak > kept


def test_where_memory_is_held_and_what_the_peak_held():
    with LiveBytes(trace="test_memory_counter") as mem:
        big = torch.zeros(1000)
        small = torch.zeros(10)
        temp = big * 2
        del temp
        live = mem.live()
        assert [e.nbytes for e in live] == [1000 * F32, 10 * F32]
        assert live[0].op == "aten::zeros" and "test_memory_counter.py" in live[0].where
        assert sum(e.nbytes for e in mem.at_peak) == mem.peak == 2010 * F32
        assert mem.by_op() == {"aten::zeros": 1010 * F32}
        assert mem.by_device() == {"cpu": 1010 * F32}
    del big, small


def test_reset_peak_starts_again_from_what_is_alive():
    with LiveBytes() as mem:
        x = torch.zeros(100)
        y = x * 2
        del y
        assert mem.peak == 200 * F32
        mem.reset_peak()
        assert mem.peak == 100 * F32
    del x


def test_measure_step_counts_what_a_model_keeps():
    """q, k, v made inside and dropped: SDPA keeps exactly q, k, v, out and the LSE."""
    b, s, h, d = 1, 64, 2, 16
    leaves = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(3)]
    grad = torch.randn(b, h, s, d)
    step = measure_step(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), leaves, grad)
    unit = b * s * h * d * F32
    assert step.kept == 4 * unit + b * h * s * F32
    assert step.after == 3 * unit  # the gradients of the leaves
    assert step.peak >= 7 * unit
    assert step.ratios(StepMemory(step.kept, step.peak, 0)) == (1.0, 1.0)
