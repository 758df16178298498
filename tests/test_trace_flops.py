"""The trace does not depend on counting FLOPs (issue 22, item 4): a FLOP formula that raises
costs its operator's count, never the activations; grouped-query attention, whose formula raises
on torch 2.11 ("sdpa_flop_count: query/key/value shapes are incompatible", fixed in 2.12), is
counted by autoshard's own formula, as torch >= 2.12 counts it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.flop_counter as flop_counter
from torch import nn

import autoshard
from autoshard.measure.flops import sdpa_backward_flops, sdpa_flops
from autoshard.measure.trace import profile_step

B, HQ, HKV, LQ, LK, D, DV = 2, 8, 2, 5, 7, 4, 6  # batch, query/kv heads, lengths, dims


def test_gqa_attention_flops_match_a_hand_count() -> None:
    query, key, value, grad_out = (B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, DV), (B, HQ, LQ, DV)
    # Key/value heads broadcast to the query's 8: every matmul runs over B * HQ = 16 heads,
    # 2 FLOPs per multiply-add.
    scores = 2 * B * HQ * LQ * LK * D  # q @ k^T: 4480
    out = 2 * B * HQ * LQ * LK * DV  # scores @ v: 6720
    assert sdpa_flops(query, key, value) == scores + out == 11200
    grad_scores = 2 * B * HQ * LQ * LK * DV  # grad_out @ v^T
    grad_v = 2 * B * HQ * LK * LQ * DV  # scores^T @ grad_out
    grad_q = 2 * B * HQ * LQ * LK * D  # grad_scores @ k
    grad_k = 2 * B * HQ * D * LQ * LK  # q^T @ grad_scores
    backward = scores + grad_scores + grad_v + grad_q + grad_k  # scores recomputed first
    assert sdpa_backward_flops(grad_out, query, key, value) == backward == 26880


def test_gqa_attention_flops_agree_with_torch_where_torch_counts_them() -> None:
    query, key, value, grad_out = (B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, DV), (B, HQ, LQ, DV)
    try:
        forward = flop_counter.sdpa_flop_count(query, key, value)
        backward = flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)
    except AssertionError:
        pytest.skip(f"torch {torch.__version__} cannot count grouped-query attention (< 2.12)")
    assert sdpa_flops(query, key, value) == forward
    assert sdpa_backward_flops(grad_out, query, key, value) == backward
    plain = (B, HQ, LK, D)  # as many key/value heads as query heads
    assert sdpa_flops(query, plain, plain) == flop_counter.sdpa_flop_count(query, plain, plain)


def test_attention_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        sdpa_flops((B, 6, LQ, D), (B, 4, LK, D), (B, 4, LK, D))  # 4 kv heads do not divide 6
    with pytest.raises(ValueError, match="not the output's shape"):
        sdpa_backward_flops((B, HQ, LQ, D + 1), (B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, D))


# ---------------------------------------------------------------------------------------------
# A formula that raises costs its count, not the trace


def _mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])


def _sum_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.sum()


def _raising(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("addmm_flop: a formula broken on this torch")


def test_a_raising_flop_formula_costs_its_count_not_the_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, batch = _mlp(), torch.randn(16, 32)  # 2-d input: nn.Linear runs aten.addmm
    counted = profile_step(model, list(model), batch, _sum_loss, None)
    assert counted.flops_uncounted == () and counted.total_forward_flops == 3 * 2 * 16 * 32 * 32
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, _raising)
    broken = profile_step(model, list(model), batch, _sum_loss, None)
    assert broken.flops_uncounted == ("aten.addmm",)
    assert broken.total_forward_flops == 0 and broken.block_forward_flops == (0, 0, 0)
    # Every activation figure is what the intact count traced.
    assert broken.block_saved_bytes == counted.block_saved_bytes
    assert broken.block_input_bytes == counted.block_input_bytes
    assert broken.activation_bytes(0) == counted.activation_bytes(0) > 0


def test_the_plan_names_the_operator_without_a_flop_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, _raising)
    model = _mlp()
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        torch.randn(16, 32),
        world_size=2,
        device_memory="1GiB",
        mixed_precision="no",
        strategy="full_shard",  # one simulation is enough here
        loss_fn=_sum_loss,
    )
    traced = [r for r in plan.reasons if r.startswith("activations traced")]
    assert len(traced) == 1, plan.reasons
    assert "no FLOP count for aten.addmm" in traced[0]
    assert not any("activations not estimated" in r for r in plan.reasons)


# ---------------------------------------------------------------------------------------------
# Grouped-query attention through the trace


class _GQAttention(nn.Module):
    """Attention with 4 query heads sharing 2 key/value heads, through the fused kernel CUDA
    picks (`_scaled_dot_product_flash_attention`), called by name."""

    def __init__(self, width: int = 16, heads: int = 4, kv_heads: int = 2, dim: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nn.Linear(width, heads * dim)
        self.kv = nn.Linear(width, 2 * kv_heads * dim)
        self.out = nn.Linear(heads * dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, length, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        attended = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
        return self.out(attended.transpose(1, 2).reshape(b, length, -1))


def test_a_gqa_model_is_traced_with_its_attention_flops() -> None:
    """The code path that failed on torch 2.11 before issue 22 (the assertion aborted the trace
    and the activations were lost), on CPU. `F.scaled_dot_product_attention` cannot reach it on
    CPU: there it runs `_scaled_dot_product_flash_attention_for_cpu`, for which torch 2.11-2.13
    have no formula (see the next test). So the model calls the fused operator CUDA runs by
    name; on fake tensors its meta kernel runs on CPU and the counter meets it as on a GPU."""
    model = nn.Sequential(_GQAttention(), _GQAttention())
    batch = torch.randn(2, 8, 16)  # 2 sequences of 8 tokens
    profile = profile_step(model, list(model), batch, _sum_loss, None)
    tokens = 2 * 8
    linears = 2 * tokens * 16 * (16 + 16 + 16)  # q (4 heads x 4), kv (2 x 2 heads x 4), out
    attention = sdpa_flops((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4))  # 8192
    assert profile.block_forward_flops == (linears + attention,) * 2
    assert profile.total_forward_flops == 2 * (linears + attention)
    assert all(saved > 0 for saved in profile.block_saved_bytes)
    assert profile.flops_uncounted == ()
    try:
        flop_counter.sdpa_flop_count((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4))
    except AssertionError:  # torch < 2.12: its formula raised, autoshard's counted
        assert profile.flops_by_own_formula == ("aten._scaled_dot_product_flash_attention",)
    else:
        assert profile.flops_by_own_formula == ()


class _Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (4, 8)).transpose(1, 2)  # 4 heads of 8
        out = nn.functional.scaled_dot_product_attention(q, q, q)
        return out.transpose(1, 2).flatten(-2)


def test_attention_on_the_cpu_is_counted_as_flops_not_traffic() -> None:
    """On CPU, `F.scaled_dot_product_attention` runs `_scaled_dot_product_flash_attention_for_cpu`,
    which torch has no formula for before 2.15: counted 0 FLOPs, silently, and its bytes as
    memory traffic (a plan for GPUs made on a CPU host, a model traced on the CPU). autoshard's
    formula counts it as torch counts the other fused kernels."""
    model = nn.Sequential(nn.Linear(32, 32), _Attention())
    batch = torch.randn(2, 16, 32)
    profile = profile_step(model, [model[1]], batch, _sum_loss, None)
    assert profile.block_forward_flops == (sdpa_flops((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)),)
    assert profile.flops_uncounted == ()
    assert profile.block_forward_traffic == (0,)  # a view and the attention: nothing unpriced


class _Experts(nn.Module):
    """4 experts of 16 -> 24 features, each given 8 of 32 token rows (a mixture of experts'
    expert matmuls, as transformers runs them: `torch._grouped_mm`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16, 24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(8, 33, 8, dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x, self.weight, offs=offsets)


def testgrouped_mm_flops_match_a_hand_count() -> None:
    """`_grouped_mm` has no formula in torch: a mixture of experts' expert matmuls, most of its
    FLOPs, counted 0 and priced as memory traffic."""
    from autoshard.measure.flops import grouped_mm_flops

    def shapes(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
        return grouped_mm_flops((torch.empty(a, device="meta"), torch.empty(b, device="meta")))

    assert shapes((32, 16), (4, 16, 24)) == 2 * 32 * 16 * 24  # rows split among 4 experts
    assert shapes((4, 8, 16), (4, 16, 24)) == 4 * 2 * 8 * 16 * 24  # batched
    assert shapes((16, 32), (32, 24)) == 2 * 16 * 32 * 24  # weight gradient: groups along K
    assert shapes((4, 8, 16), (16, 96)) == 2 * 8 * 16 * 96  # groups along N
    assert shapes((16,), (16, 24)) is None

    model = nn.Sequential(_Experts())
    profile = profile_step(model, list(model), torch.randn(32, 16), _sum_loss, None)
    assert profile.block_forward_flops == (2 * 32 * 16 * 24,)
    assert profile.flops_uncounted == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gqa_model_is_traced_on_cuda() -> None:
    """`F.scaled_dot_product_attention(enable_gqa=True)` on a GPU, whichever fused kernel runs.
    On one H100 with torch 2.11 bf16 ran `_scaled_dot_product_cudnn_attention`, whose formula
    raised there until autoshard's counted it (checked 2026-11-24)."""

    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.unflatten(-1, (8, 64)).transpose(1, 2)  # 8 query heads
            kv = q[:, :2]  # 2 key/value heads
            out = nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            return out.transpose(1, 2).flatten(-2)

    model = nn.Sequential(nn.Linear(512, 512), Attention(), nn.Linear(512, 512)).cuda()
    batch = torch.randn(2, 128, 512, device="cuda")
    profile = profile_step(model, [model[1]], batch, _sum_loss, torch.bfloat16)
    # Whichever kernel runs (fused, or the math path's matmuls), the attention counts as this.
    kv = (2, 2, 128, 64)
    assert profile.block_forward_flops == (sdpa_flops((2, 8, 128, 64), kv, kv),)
    assert profile.flops_uncounted == ()
    assert profile.activation_bytes(0) > 0


class _Reversible(torch.autograd.Function):
    """A reversible residual pair (RevNet; Reformer's layers): y1 = x1 + f(x2), y2 = x2 + g(y1),
    run without autograd in forward and recomputed from the outputs in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: nn.Module, g: nn.Module) -> torch.Tensor:
        ctx.f, ctx.g = f, g
        x1, x2 = x.chunk(2, -1)
        with torch.no_grad():
            y1 = x1 + f(x2)
            out = torch.cat([y1, x2 + g(y1)], -1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        y1, y2 = out.chunk(2, -1)
        g1, g2 = grad.chunk(2, -1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, g2)
            x2 = (y2 - gy1).detach().requires_grad_(True)
            g1 = g1 + y1.grad
            torch.autograd.backward(ctx.f(x2), g1)
        return torch.cat([g1, g2 + x2.grad], -1), None, None


class _RevBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))
        self.g = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reversible.apply(x, self.f, self.g)


class _RevNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([_RevBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_modules_called_inside_a_custom_autograd_function_are_traced() -> None:
    """torch's ModuleTracker, inside FlopCounterMode, hooks each module call's inputs for
    backward and fails on a module a custom autograd Function calls ("Expected gradient function
    to be set"): a reversible network (Reformer) lost its whole trace, on fake and on real
    tensors, and the plan left its activations out with a warning."""
    model = _RevNet()
    batch = torch.randn(16, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    # fp32: this backward recomputes outside autocast, as its forward's outputs allow
    plan = autoshard.plan(model, optimizer, batch, world_size=2, mixed_precision="no")
    note = next(r for r in plan.reasons if "activations" in r and "example batch" in r)
    assert note.startswith("activations traced from the example batch"), note
    profile = profile_step(model, [b for b in model.blocks], batch, None, None)
    # each block's forward counted: its two linears, 2 * 16 rows * 32 * 32 FLOPs each
    assert profile.block_forward_flops == (2 * 2 * 16 * 32 * 32,) * 3
