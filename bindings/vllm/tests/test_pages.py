"""The plugin reads vLLM's pages in the kernel's own layout: what vLLM's page write stores is
read back exactly, for float32 and bfloat16 and several block and head sizes."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

current_platform.import_kernels()

from vllm import _custom_ops as ops  # noqa: E402

from mosaickv_vllm.backend import page_layout  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,d,h", [(32, 64, 3), (32, 128, 2), (64, 64, 1)])
def test_pages_read_back_what_vllm_wrote(dtype, bs, d, h):
    g = torch.Generator().manual_seed(bs * 1000 + d)
    nb, tokens = 4, 3 * bs - 5
    pages = torch.zeros(nb, h, bs, 2 * d, dtype=dtype)
    key_cache, value_cache = pages.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    keys = torch.randn(tokens, h, d, generator=g).to(dtype)
    values = torch.randn(tokens, h, d, generator=g).to(dtype)
    blocks = torch.tensor([2, 0, 3])  # a sequence's block table, out of order
    slots = torch.stack([blocks[t // bs] * bs + t % bs for t in range(tokens)]).long()
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    where = page_layout("vec", dtype, bs, d)
    rows = pages.view(nb, h, 2, bs * d)[blocks]
    k = rows[:, :, 0, where[0]].view(3, h, bs, d).permute(0, 2, 1, 3).reshape(3 * bs, h, d)
    v = rows[:, :, 1, where[1]].view(3, h, bs, d).permute(0, 2, 1, 3).reshape(3 * bs, h, d)
    assert torch.equal(k[:tokens], keys)
    assert torch.equal(v[:tokens], values)
