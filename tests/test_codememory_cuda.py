"""codememory on CUDA wrapper code: what the caching allocator counts (512-byte blocks), the dtypes of
fallback outputs the text does not give, the attention seeds that live on the host, against the figures
an H100 measured (docs/cuda-replay.md has the analysis)."""

import gzip
import pathlib

import pytest

from fxoffload.analysis.code_memory import simulate_output_code
from fxoffload.sizes import CUDA_BLOCK_BYTES
from fxoffload.sizes import cuda_block_bytes as cuda_allocated_bytes

from .test_codememory import BW_NOTHING, above_start, wrapper

DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize(
    "requested, counted",
    [(0, 0), (1, 512), (4, 512), (8, 512), (512, 512), (513, 1024), (2048, 2048), (524288, 524288),
     (16777217, 16777728)],  # fmt: skip
)
def test_the_caching_allocator_counts_blocks_of_512_bytes(requested, counted):
    assert CUDA_BLOCK_BYTES == 512
    assert cuda_allocated_bytes(requested) == counted


def _scalar_step(device):
    fw = wrapper(
        f"""
        primals_1, = args
        args.clear()
        buf0 = empty_strided_{device}((), (), torch.float32)
        kernel_sum_0(primals_1, buf0)
        buf1 = empty_strided_{device}((3, ), (1, ), torch.int64)
        return (buf0, buf1, )
        """,
        f"primals_1 = rand_strided((8, 64), (64, 1), device='{device}', dtype=torch.float32)",
    )
    return simulate_output_code(fw, BW_NOTHING, num_fwd_outputs=2)


def test_cpu_code_is_counted_to_the_byte_cuda_code_in_blocks():
    cpu = [above_start(p) for p in _scalar_step("cpu").points]
    cuda = [above_start(p) for p in _scalar_step("cuda").points]
    assert max(cpu) == 4 + 24
    assert max(cuda) == 512 + 512
    assert _scalar_step("cuda").points[0].live["inputs"] == 2048


# Layer 0's attention in the forward Inductor generated on the H100 for the 12-layer stack under bf16
# autocast (/work/shared/gpu/reports_auto.json.gz, forward lines 1775-1787: q was ``buf11``, an alias of
# the first reinterpret_tensor, written out here), and the backward's asserts and get_args for the saved
# outputs (backward lines 1450-1452 and 3814-3816; the backward here only frees them).
H100_CUDNN_FW = wrapper(
    """
    buf7, = args
    args.clear()
    buf12 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(reinterpret_tensor(buf7, (8, 16, 1024, 64), (3145728, 64, 3072, 1), 0), reinterpret_tensor(buf7, (8, 16, 1024, 64), (3145728, 64, 3072, 1), 1024), reinterpret_tensor(buf7, (8, 16, 1024, 64), (3145728, 64, 3072, 1), 2048), None, True, 0.0, True)
    buf13 = buf12[0]
    assert_size_stride(buf13, (8, 16, 1024, 64), (1048576, 64, 1024, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    assert_alignment(buf13, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    buf14 = buf12[1]
    assert_size_stride(buf14, (8, 16, 1024, 1), (16384, 1024, 1, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    assert_alignment(buf14, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    buf15 = buf12[6]
    assert_size_stride(buf15, (), (), 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    assert_alignment(buf15, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    buf16 = buf12[7]
    assert_size_stride(buf16, (), (), 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    assert_alignment(buf16, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention.default')
    del buf12
    return (buf13, buf14, buf15, buf16, )
    """,
    "buf7 = rand_strided((8192, 3072), (3072, 1), device='cuda:0', dtype=torch.bfloat16)",
)
H100_CUDNN_BW = wrapper(
    """
    getitem_3, getitem_8, getitem_9, tangents_1 = args
    args.clear()
    assert_size_stride(getitem_3, (8, 16, 1024, 1), (16384, 1024, 1, 1))
    assert_size_stride(getitem_8, (), ())
    assert_size_stride(getitem_9, (), ())
    del getitem_3
    del getitem_8
    del getitem_9
    return (None, )
    """,
    """
    getitem_3 = rand_strided((8, 16, 1024, 1), (16384, 1024, 1, 1), device='cuda:0', dtype=torch.float32)
    getitem_8 = rand_strided((), (), device='cuda:0', dtype=torch.int64)
    getitem_9 = rand_strided((), (), device='cuda:0', dtype=torch.int64)
    tangents_1 = rand_strided((8, 16, 1024, 64), (1048576, 64, 1024, 1), device='cuda:0', dtype=torch.bfloat16)
    """,
)


def test_cudnn_attention_under_autocast_saves_a_float32_logsumexp_and_two_device_seeds():
    timeline = simulate_output_code(H100_CUDNN_FW, H100_CUDNN_BW, num_fwd_outputs=1)
    end = [p for p in timeline.points if p.phase == "forward"][-1]
    out = 8 * 16 * 1024 * 64 * 2  # bf16, the user output here
    lse = 8 * 16 * 1024 * 4  # float32 (the first argument's bf16 would be half of it)
    seeds = 2 * 512  # int64 scalars on the device (at::zeros({1}, cuda)): a block each
    assert end.live["transient"] == out
    assert end.live["saved"] == lse + seeds == 525312
    assert above_start(timeline.peak) == out + lse + seeds + out  # + the bf16 tangent in the backward


# The first attention and dropout of the GPT of tests/test_cuda.py (fp32, dropout 0.1), as Inductor
# writes them for an H100 (tests/data/gpt_cuda_forward.py.gz, from tests/data/gen_gpt_cuda_code.py).
EFFICIENT_FW = wrapper(
    """
    buf8, buf14 = args
    args.clear()
    buf9 = torch.ops.aten._scaled_dot_product_efficient_attention.default(reinterpret_tensor(buf8, (8, 4, 256, 64), (196608, 64, 768, 1), 0), reinterpret_tensor(buf8, (8, 4, 256, 64), (196608, 64, 768, 1), 256), reinterpret_tensor(buf8, (8, 4, 256, 64), (196608, 64, 768, 1), 512), None, True, 0.1, True)
    buf10 = buf9[0]
    assert_size_stride(buf10, (8, 4, 256, 64), (65536, 64, 256, 1), 'torch.ops.aten._scaled_dot_product_efficient_attention.default')
    buf11 = buf9[1]
    assert_size_stride(buf11, (8, 4, 256), (1024, 256, 1), 'torch.ops.aten._scaled_dot_product_efficient_attention.default')
    buf12 = buf9[2]
    assert_size_stride(buf12, (), (), 'torch.ops.aten._scaled_dot_product_efficient_attention.default')
    buf13 = buf9[3]
    assert_size_stride(buf13, (), (), 'torch.ops.aten._scaled_dot_product_efficient_attention.default')
    del buf9
    buf15 = torch.ops.aten.native_dropout.default(reinterpret_tensor(buf14, (8, 256, 256), (65536, 256, 1), 0), 0.1, True)
    buf16 = buf15[0]
    assert_size_stride(buf16, (8, 256, 256), (65536, 256, 1), 'torch.ops.aten.native_dropout.default')
    buf17 = buf15[1]
    assert_size_stride(buf17, (8, 256, 256), (65536, 256, 1), 'torch.ops.aten.native_dropout.default')
    del buf15
    return (buf10, buf11, buf12, buf13, buf16, buf17, )
    """,
    """
    buf8 = rand_strided((2048, 768), (768, 1), device='cuda:0', dtype=torch.float32)
    buf14 = rand_strided((2048, 256), (256, 1), device='cuda:0', dtype=torch.float32)
    """,
)


def test_efficient_attention_seeds_are_host_scalars_and_a_dropout_mask_is_bool():
    timeline = simulate_output_code(EFFICIENT_FW, BW_NOTHING, num_fwd_outputs=6)
    end = [p for p in timeline.points if p.phase == "forward"][-1]
    out = 8 * 4 * 256 * 64 * 4
    lse = 8 * 4 * 256 * 4
    seeds = 0  # CPU int64 scalars at run time (measured on the H100: /work/shared/gpu/sdpa_seed_devices.txt)
    dropped, mask = 8 * 256 * 256 * 4, 8 * 256 * 256 * 1  # the mask is bool, not its input's float32
    assert end.live["transient"] == out + lse + seeds + dropped + mask == 4751360


def test_a_saved_fallback_output_takes_its_dtype_from_the_backwards_get_args():
    """An op the table does not know: ``native_layer_norm`` of bf16 on CUDA returns float32 mean and rstd
    (its accumulation type); the backward's ``get_args`` says so for the one it saves."""
    fw = wrapper(
        """
        primals_1, primals_2 = args
        args.clear()
        buf0 = torch.ops.aten.native_layer_norm.default(primals_1, [64], primals_2, None, 1e-05)
        buf1 = buf0[0]
        assert_size_stride(buf1, (1024, 64), (64, 1), 'torch.ops.aten.native_layer_norm.default')
        buf2 = buf0[2]
        assert_size_stride(buf2, (1024, 1), (1, 1), 'torch.ops.aten.native_layer_norm.default')
        del buf0
        return (buf1, buf2, )
        """,
        """
        primals_1 = rand_strided((1024, 64), (64, 1), device='cuda:0', dtype=torch.bfloat16)
        primals_2 = rand_strided((64, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
        """,
    )
    bw = wrapper(
        """
        getitem_2, tangents_1 = args
        args.clear()
        del getitem_2
        return (None, None, )
        """,
        """
        getitem_2 = rand_strided((1024, 1), (1, 1), device='cuda:0', dtype=torch.float32)
        tangents_1 = rand_strided((1024, 64), (64, 1), device='cuda:0', dtype=torch.bfloat16)
        """,
    )
    end = [p for p in simulate_output_code(fw, bw).points if p.phase == "forward"][-1]
    assert end.live["saved"] == 1024 * 4  # float32, where the first argument's bf16 would say 2048
    assert end.live["transient"] == 1024 * 64 * 2


def test_copy_if_misaligned_is_its_input():
    """torch 2.13 writes ``x = copy_if_misaligned(x)`` for inputs: a copy only if the data is not
    16-byte aligned, never the case for a whole block."""
    fw = wrapper(
        """
        primals_1, = args
        args.clear()
        primals_1 = copy_if_misaligned(primals_1)
        buf0 = empty_strided_cuda((8, 256), (256, 1), torch.int64)
        kernel_0(primals_1, buf0)
        del primals_1
        return (buf0, )
        """,
        "primals_1 = rand_strided((8, 256), (256, 1), device='cuda:0', dtype=torch.int64)",
    )
    timeline = simulate_output_code(fw, BW_NOTHING, num_fwd_outputs=1)
    assert max(above_start(p) for p in timeline.points) == 16384  # buf0 only: primals_1 is the caller's


def test_the_gpt_of_test_cuda_replays_to_the_h100_allocators_peak():
    """tests/test_cuda.py::test_the_prediction_is_the_cuda_allocators_peak[none] on an H100 (torch 2.11):
    ``max_memory_allocated`` 82973696 B above the step's start; the replay before this model said
    89264148 (+7.6%), of which 6291456 are the four dropout masks counted as float32 (bool at run time).
    The code here is generated on a CPU for a fake H100; the main branch's replay of it gives the
    H100 run's 89264148 to the byte (without torch 2.13's copy_if_misaligned lines)."""
    fw = gzip.open(DATA / "gpt_cuda_forward.py.gz", "rt").read()
    bw = gzip.open(DATA / "gpt_cuda_backward.py.gz", "rt").read()
    timeline = simulate_output_code(fw, bw)
    predicted = above_start(timeline.peak)
    assert predicted == 82973184
    assert abs(predicted / 82973696 - 1) < 1e-4
    # line 52 of the untrimmed code: the backward's first (8, 256, 256) buffer, every saved tensor still live
    assert timeline.peak.node.startswith("backward line 39: buf10 = empty_strided_cuda((8, 256, 256)")
    params_and_inputs = timeline.peak.live["parameters"] + timeline.peak.live["inputs"]
    assert params_and_inputs == 7139328  # report.start_bytes of that run: every block a multiple of 512
