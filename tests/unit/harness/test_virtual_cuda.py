"""The emulated CUDA device (megatron_hcp.harness.virtual_cuda): devices reported as on a
GPU, every mix found - forward, backward, collectives - and none where CUDA would run; a CPU run's
uses of CUDA.

The emulation changes its process for good (torch believes CUDA was initialized), so every case
runs in the ranks of one pooled world (2 gloo ranks, for the collectives)."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.harness.local_world import LocalWorld

WORLD = 2


@pytest.fixture(scope="module")
def world():
    with LocalWorld(WORLD) as w:
        yield w


def _lines(audit) -> list[str]:
    return [m.line() for m in audit.mixes]


# ------------------------------------------------------------------------------ on each rank
def devices_as_on_a_gpu() -> dict:
    """What Python code sees of tensors and of torch.cuda."""
    import torch.distributed as dist

    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    rank = dist.get_rank()
    with virtual_cuda(rank) as audit:
        torch.cuda.set_device(rank)
        x = torch.randn(4, 4, device="cuda")
        lin = torch.nn.Linear(4, 4).cuda()
        seen = {
            "available": torch.cuda.is_available(), "current": torch.cuda.current_device(),
            "factory": str(x.device), "is_cuda": x.is_cuda, "get_device": x.get_device(),
            "view": str(x[1:].t().device), "data": str(x.data.device),
            "module": str(lin.weight.device), "output": str(lin(x).device),
            "to_cpu": str(x.to("cpu").device), "cpu": str(x.cpu().device),
            "x_stays": str(x.device), "to_other": str(torch.ones(2).to(x).device),
            "cast": str(x.to(torch.float64).device),
            "to_positional": str(torch.ones(2).to("cuda", None, False).device),
            "tensor": str(torch.tensor([1, 2], device="cuda").device),
            "as_tensor": str(torch.as_tensor([1.0], device="cuda").device),
            "new_tensor": str(x.new_tensor([1.0]).device), "new_zeros": str(x.new_zeros(2).device),
            "like": str(torch.empty_like(x).device), "int_device": str(
                torch.zeros(1, device=torch.cuda.current_device()).device),
            "plain": str(torch.ones(2).device), "stream": torch.cuda.current_stream().query(),
        }
        with torch.cuda.device(0):
            seen["in_device_0"] = str(torch.zeros(1, device="cuda").device)
    seen["mixes"] = _lines(audit)
    seen["after"] = (torch.Tensor.device.__get__(x).type, x.is_cuda)  # the properties return
    return seen


def a_forward_mix() -> list[str]:
    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    with virtual_cuda(0) as audit:
        x = torch.randn(4, device="cuda")
        x * torch.ones(4)  # the mix: cuda and a CPU tensor that is no scalar
        x * torch.tensor(2.0)  # a CPU scalar is allowed, as in CUDA kernels
        x[torch.tensor([0, 1])]  # CPU indices of a CUDA tensor are allowed
        torch.ones(4).copy_(x)  # copies cross devices
        x.cpu() + torch.ones(4)
    return _lines(audit)


class _BackwardOnCpu(torch.autograd.Function):
    """Forward on the input's device; backward returns a gradient made on the CPU (a device bug
    of a hand-written backward)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.ones(grad.shape)  # mixes on the GPU


def backward_mixes_and_clean_backwards() -> dict:
    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    out: dict = {}
    with virtual_cuda(0) as clean:
        w = torch.randn(6, 3, device="cuda", requires_grad=True)
        src = torch.randn(5, 3, requires_grad=True)  # on the CPU, moved into the graph
        idx = torch.tensor([4, 0, 2], device="cuda")
        y = (w[1:4] * src.cuda()[0:3]).sum() + w.index_select(0, idx).sum() + w.select(0, 5).sum()
        y.backward()
        out["grads"] = (str(w.grad.device), str(src.grad.device))
    out["clean"] = _lines(clean)
    with virtual_cuda(0) as bad:
        x = torch.randn(3, device="cuda", requires_grad=True)
        _BackwardOnCpu.apply(x).sum().backward()
    out["bad"] = [m.to_json() for m in bad.mixes]
    return out


def random_ops_use_the_device_generator() -> dict:
    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    with virtual_cuda(0):
        torch.cuda.manual_seed(7)
        cpu_before = torch.get_rng_state()
        a = torch.randn(3, device="cuda")
        cpu_unchanged = torch.equal(cpu_before, torch.get_rng_state())
        torch.cuda.manual_seed(7)
        b = torch.randn(3, device="cuda")
        state = torch.cuda.get_rng_state()
    return {"cpu_unchanged": cpu_unchanged, "repeatable": torch.equal(a, b),
            "state_on_cpu": str(state.device)}


def collectives_over_nccl_groups() -> list[str]:
    import torch.distributed as dist

    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    rank = dist.get_rank()
    with virtual_cuda(rank) as audit:
        torch.cuda.set_device(rank)
        ok = torch.ones(2, device="cuda")
        dist.all_reduce(ok)  # NCCL on a CUDA tensor
        on_cpu = torch.ones(2)
        dist.all_reduce(on_cpu)  # NCCL cannot take a CPU tensor
        gloo = dist.new_group([0, 1], backend="gloo")
        dist.all_reduce(torch.ones(2), group=gloo)  # a gloo group can
        backends = (dist.get_backend(), dist.get_backend(gloo))
        objects: list = [None] * dist.get_world_size()
        dist.all_gather_object(objects, rank)  # torch's object collectives are fine
        total = float(ok[0])
    dist.destroy_process_group(gloo)
    return [*_lines(audit), f"backends {backends}", f"sum {total}", f"objects {objects}"]


def cpu_run_findings() -> list[str]:
    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    with virtual_cuda(0, cpu_run=True) as audit:
        assert torch.cuda.is_available()  # a machine with CUDA; asking is not using it
        torch.cuda.device_count()
        x = torch.ones(3)
        torch.optim.SGD([torch.nn.Parameter(x)], lr=0.1).step()  # torch's own probes: no finding
        torch.cuda.get_rng_state()  # the run's code using CUDA: a finding
        x.cuda()  # a tensor placed on a GPU: a finding
    return _lines(audit)


# ------------------------------------------------------------------------------ tests
@pytest.mark.multirank
def test_tensors_and_torch_cuda_look_like_a_gpu(world):
    for rank, seen in enumerate(world.run(devices_as_on_a_gpu)):
        cuda = f"cuda:{rank}"
        assert seen["available"] and seen["current"] == rank and seen["stream"]
        for key in ("factory", "view", "data", "module", "output", "x_stays", "to_other",
                    "cast", "tensor", "as_tensor", "new_tensor", "new_zeros", "like"):
            assert seen[key] == cuda, (key, seen[key])
        assert seen["to_positional"] == cuda and seen["int_device"] == cuda
        assert seen["is_cuda"] and seen["get_device"] == rank
        assert seen["to_cpu"] == seen["cpu"] == seen["plain"] == "cpu"
        assert seen["in_device_0"] == "cuda:0"
        assert seen["mixes"] == []
        assert seen["after"] == ("cpu", False)  # torch is itself again after the emulation


@pytest.mark.multirank
def test_a_forward_mix_is_named_with_its_file_and_line(world):
    lines = world.run(a_forward_mix)[0]
    assert len(lines) == 1, lines  # scalars, CPU indices and copies are no mixes
    assert lines[0].startswith("device mix: aten.mul.Tensor on cuda:0 and cpu at "
                               "tests/unit/harness/test_virtual_cuda.py:")
    assert "in a_forward_mix" in lines[0]


@pytest.mark.multirank
def test_backward_mixes_are_found_and_torch_backwards_are_clean(world):
    got = world.run(backward_mixes_and_clean_backwards)[0]
    assert got["clean"] == []  # index_select / select / slice backwards, a move's gradient
    assert got["grads"] == ("cuda:0", "cpu")  # a moved tensor's gradient goes back
    assert len(got["bad"]) == 1
    bad = got["bad"][0]
    assert bad["phase"] == "backward" and bad["op"] == "aten.mul.Tensor"
    # located at the forward op of the node whose backward mixed
    assert "tests/unit/harness/test_virtual_cuda.py:" in bad["location"]
    assert "backward_mixes_and_clean_backwards" in bad["location"]


@pytest.mark.multirank
def test_random_ops_draw_from_the_devices_generator(world):
    got = world.run(random_ops_use_the_device_generator)[0]
    assert got == {"cpu_unchanged": True, "repeatable": True, "state_on_cpu": "cpu"}


@pytest.mark.multirank
def test_collectives_over_nccl_groups_need_cuda_tensors(world):
    for lines in world.run(collectives_over_nccl_groups):
        mixes = [line for line in lines if line.startswith("device mix")]
        assert len(mixes) == 1, lines
        assert "c10d.allreduce_.default over an NCCL group on cpu" in mixes[0]
        assert "in collectives_over_nccl_groups" in mixes[0]
        assert "backends ('nccl', 'gloo')" in lines
        assert "sum 2.0" in lines and "objects [0, 1]" in lines


@pytest.mark.multirank
def test_a_cpu_run_reports_its_own_uses_of_cuda(world):
    lines = world.run(cpu_run_findings)[0]
    assert len(lines) == 2, lines
    assert lines[0].startswith("CUDA used by a CPU run: torch.cuda.get_rng_state() at "
                               "tests/unit/harness/test_virtual_cuda.py:")
    assert lines[1].startswith("CUDA used by a CPU run: a tensor placed on cuda:0 at")


def test_bad_index_is_refused():
    from megatron_hcp.harness.virtual_cuda import virtual_cuda

    with pytest.raises(ValueError, match="index=8 must be in 0..7"):
        with virtual_cuda(8):
            pass
