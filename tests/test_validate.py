"""Bad input to `autoshard.prepare`: every case raises a message that names the problem, and raises
before anything is changed (parameters bitwise and by identity, the optimizer's param groups, the
RNG). Single process; the already-wrapped cases build a one-rank gloo group of their own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _torch_release import SHAPE_ERROR_PREFIX
from torch import nn

import autoshard
from autoshard.measure import facts

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not launched by torchrun, whatever the environment says: prepare must not start a group."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(4, 8)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Unchanged:
    """What prepare must leave alone when it refuses its arguments."""

    def __init__(self, model: Any, optimizer: Any, watch: nn.Module | None = None) -> None:
        """`watch`: the module whose parameters to check when `model` is not a module."""
        module = model if isinstance(model, nn.Module) else watch
        self.model, self.optimizer = module, optimizer
        self.params = list(module.named_parameters()) if module is not None else []
        self.values = [_local(p).detach().clone() for _, p in self.params]
        self.modules = [(n, type(m)) for n, m in module.named_modules()] if module else []
        self.groups = [
            list(g["params"]) for g in getattr(optimizer, "param_groups", [])
        ]  # the objects, not copies
        self.options = [
            {k: v for k, v in g.items() if k != "params"}
            for g in getattr(optimizer, "param_groups", [])
        ]
        self.rng = torch.get_rng_state()

    def check(self) -> None:
        if isinstance(self.model, nn.Module):
            now = list(self.model.named_parameters())
            assert [n for n, _ in now] == [n for n, _ in self.params]
            for (_, param), (_, old), value in zip(now, self.params, self.values, strict=True):
                assert param is old  # the same parameter objects
                assert torch.equal(_local(param), value)  # bitwise unchanged
                assert param.grad is None
            assert [(n, type(m)) for n, m in self.model.named_modules()] == self.modules
            assert "forward" not in vars(self.model)  # no autocast wrapper installed
        if isinstance(self.optimizer, torch.optim.Optimizer):
            groups = self.optimizer.param_groups
            assert len(groups) == len(self.groups)
            for group, old in zip(groups, self.groups, strict=True):
                assert len(group["params"]) == len(old)
                assert all(a is b for a, b in zip(group["params"], old, strict=True))
            options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
            assert options == self.options
            assert not self.optimizer.state
        assert torch.equal(torch.get_rng_state(), self.rng)


def refuses(
    error: type[Exception],
    match: str,
    model: Any,
    optimizer: Any,
    batch: Any = None,
    *,
    watch: nn.Module | None = None,
    **options: Any,
) -> str:
    unchanged = Unchanged(model, optimizer, watch)
    with pytest.raises(error, match=match) as info:
        autoshard.prepare(model, optimizer, batch, **options)
    unchanged.check()
    return str(info.value)


# --- the model and the optimizer -----------------------------------------------------------------


def test_model_that_is_not_a_module() -> None:
    model, optimizer, batch = make()
    message = refuses(
        TypeError, "model must be a torch.nn.Module", model.forward, optimizer, batch, watch=model
    )
    assert "method" in message  # the type it got


def test_optimizer_that_is_not_an_optimizer() -> None:
    model, _, batch = make()
    params = list(model.parameters())
    message = refuses(TypeError, "optimizer must be a torch.optim.Optimizer", model, params, batch)
    assert "list" in message


def test_optimizer_holding_a_parameter_the_model_does_not_own() -> None:
    model, _, batch = make()
    stranger = nn.Parameter(torch.zeros(3, 5))
    optimizer = torch.optim.AdamW([*model.parameters(), stranger], lr=1e-3)
    message = refuses(ValueError, "model does not own", model, optimizer, batch)
    assert "(3, 5)" in message  # names the parameter by its shape
    assert "build the optimizer on model.parameters()" in message  # and gives the fix


def test_model_wrapped_in_data_parallel() -> None:
    model, optimizer, batch = make()
    wrapped = nn.DataParallel(model)  # on CPU this holds the module and does nothing else
    message = refuses(ValueError, "wrapped in torch.nn.DataParallel", wrapped, optimizer, batch)
    # Why: obsolete, one process for every GPU, the GIL, a replica made at every forward, and
    # slower than DDP even on one machine.
    assert "obsolete" in message
    assert "one Python process" in message
    assert "GIL" in message
    assert "replicates the model onto every GPU again at every forward" in message
    assert "slower than DDP even on a single machine" in message
    # What to do: unwrap, one process per GPU under torchrun.
    assert "pass model.module" in message
    assert "one process per GPU with torchrun" in message
    assert "torchrun --nproc-per-node=N" in message
    with pytest.raises(ValueError, match="wrapped in torch.nn.DataParallel"):
        autoshard.plan(wrapped, optimizer, batch)  # what-if planning refuses it too


def test_submodule_wrapped_in_data_parallel() -> None:
    model, optimizer, batch = make()
    model.blocks[1] = nn.DataParallel(model.blocks[1])
    message = refuses(ValueError, "submodule 'blocks.1' is wrapped in", model, optimizer, batch)
    assert "replace submodule 'blocks.1' by its .module" in message


def test_model_already_wrapped_in_ddp(one_rank_group: None) -> None:
    model, optimizer, batch = make()
    wrapped = nn.parallel.DistributedDataParallel(model)
    message = refuses(
        ValueError, "already wrapped in DistributedDataParallel", wrapped, optimizer, batch
    )
    assert "model.module" in message


def test_model_already_passed_through_fully_shard(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _, batch = make()
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    message = refuses(ValueError, "already sharded with FSDP", model, optimizer, batch)
    assert "fully_shard" in message


def test_submodule_already_passed_through_fully_shard(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _, batch = make()
    fully_shard(model.blocks[1], mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refuses(ValueError, "submodule 'blocks.1' is already sharded", model, optimizer, batch)


def test_model_without_trainable_parameters() -> None:
    model, _, batch = make()
    model.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    refuses(ValueError, "no trainable parameters", model, optimizer, batch)


@pytest.mark.parametrize("lazy", ["linear", "batchnorm"])
def test_a_lazy_module_not_initialised_yet(lazy: str) -> None:
    """nn.LazyLinear had no shapes: the trace failed and the error blamed the example batch."""
    torch.manual_seed(0)
    first = nn.LazyLinear(16) if lazy == "linear" else nn.LazyBatchNorm1d()
    model = nn.Sequential(first, nn.Linear(16 if lazy == "linear" else 8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for call in (autoshard.prepare, autoshard.plan):
        with pytest.raises(ValueError, match="not initialised yet") as info:
            call(model, optimizer, torch.randn(4, 8))
        assert "'0." in str(info.value), "names the first one"
        assert "run the model once on a batch" in str(info.value)
        assert "example_batch could not be run" not in str(info.value)
    assert type(model[0]).__name__.startswith("Lazy"), "still lazy: nothing ran it"
    model(torch.randn(4, 8))  # what the message says to do
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert autoshard.plan(model, optimizer, torch.randn(4, 8)).estimated_peak_bytes > 0


# --- the options ---------------------------------------------------------------------------------


def test_unknown_strategy() -> None:
    model, optimizer, batch = make()
    message = refuses(
        ValueError, "strategy='zero4' is not one of", model, optimizer, batch, strategy="zero4"
    )
    assert "'full_shard'" in message  # lists the choices
    assert "did you mean" not in message  # nothing is close to zero4


@pytest.mark.parametrize(
    ("value", "meant"),
    [
        ("fsdp", "full_shard"),
        ("FSDP", "full_shard"),
        ("zero3", "full_shard"),
        ("zero2", "shard_grad_op"),
        ("hsdp", "hybrid_shard"),
        ("full-shard", "full_shard"),
        ("shard_grad", "shard_grad_op"),
        ("dpp", "ddp"),
    ],
)
def test_unknown_strategy_suggests_the_closest_choice(value: str, meant: str) -> None:
    model, optimizer, batch = make()
    message = refuses(
        ValueError, f"strategy={value!r} is not one of", model, optimizer, batch, strategy=value
    )
    assert message.endswith(f"; did you mean {meant!r}?"), message


def test_unknown_mixed_precision() -> None:
    model, optimizer, batch = make()
    message = refuses(
        ValueError,
        "mixed_precision='fp8' is not one of",
        model,
        optimizer,
        batch,
        mixed_precision="fp8",
    )
    assert "'bf16'" in message


@pytest.mark.parametrize("value", [-1, "some", 1.5, None])
def test_bad_activation_checkpointing(value: Any) -> None:
    model, optimizer, batch = make()
    message = refuses(
        ValueError,
        "activation_checkpointing=",
        model,
        optimizer,
        batch,
        activation_checkpointing=value,
    )
    assert "'auto'" in message and ">= 0" in message


def test_activation_checkpointing_of_more_blocks_than_the_model_has() -> None:
    model, optimizer, batch = make()
    refuses(
        ValueError, "only 2 repeated block", model, optimizer, batch, activation_checkpointing=3
    )


@pytest.mark.parametrize("value", ["lots", 0, -5])
def test_memory_limit_bad_value(value: Any) -> None:
    model, optimizer, batch = make()
    refuses(ValueError, "memory_limit", model, optimizer, batch, memory_limit=value)


@pytest.mark.parametrize("value", [True, [1]])
def test_memory_limit_bad_type(value: Any) -> None:
    model, optimizer, batch = make()
    message = refuses(
        TypeError,
        "memory_limit must be a number of bytes",
        model,
        optimizer,
        batch,
        memory_limit=value,
    )
    assert "'20GiB'" in message


def test_loss_fn_not_callable() -> None:
    model, optimizer, batch = make()
    refuses(TypeError, "loss_fn must be callable", model, optimizer, batch, loss_fn=3)


def test_trial_step_not_a_bool() -> None:
    model, optimizer, batch = make()
    refuses(
        TypeError, "trial_step must be True or False", model, optimizer, batch, trial_step="yes"
    )


@pytest.mark.parametrize("strategy", ["ddp", "shard_grad_op", "full_shard"])
def test_distributed_strategy_without_a_process_group(strategy: str) -> None:
    model, optimizer, batch = make()
    message = refuses(
        ValueError, "needs a process group", model, optimizer, batch, strategy=strategy
    )
    assert "torchrun" in message  # and says how to get one


def test_model_errors_come_before_option_errors() -> None:
    # Two problems: the model's is reported (the first argument checked).
    model, optimizer, batch = make()
    refuses(
        TypeError, "model must be", "not a model", optimizer, batch, watch=model, strategy="zero4"
    )


def test_does_not_fit_raises_before_anything_changes() -> None:
    model, optimizer, batch = make()
    message = refuses(autoshard.DoesNotFit, "missing", model, optimizer, batch, memory_limit=1024)
    assert "memory_limit" in message


# --- a batch that does not fit the model ---------------------------------------------------------


class Normed(nn.Module):
    """Batch norm (running statistics a forward in train mode would move) and dropout (which
    draws from the RNG): the check of the batch must leave both alone."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))


def test_a_batch_whose_shapes_do_not_fit_the_model_is_refused_before_wrapping(
    capfd: pytest.CaptureFixture[str],
) -> None:
    torch.manual_seed(0)
    model = Normed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = [b.clone() for b in model.buffers()]
    message = refuses(
        ValueError,
        "example_batch does not fit the model: the model's forward raises on it",
        model,
        optimizer,
        torch.randn(4, 7),
    )
    # the op's own error, briefly, and the batch's shapes
    shapes = f"{SHAPE_ERROR_PREFIX}mat1 and mat2 shapes cannot be multiplied (4x7 and 8x8)"
    assert f"(RuntimeError: {shapes})" in message
    assert "the batch holds tensors of shapes (4, 7) float32" in message
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    assert model.training and all(m.training for m in model.modules())
    # one message: not the fake tensors' logged tracebacks before it
    err = capfd.readouterr().err
    assert "failed while attempting to run meta" not in err, err


def test_a_batch_whose_shapes_do_not_fit_a_meta_model_is_refused_by_plan() -> None:
    with torch.device("meta"):
        model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, 9, device="meta")
    with pytest.raises(ValueError, match="example_batch does not fit the model") as info:
        autoshard.plan(model, optimizer, batch, world_size=2, device_memory="1GiB")
    assert "(4, 9) float32" in str(info.value)


class MixesUnderAutocast(nn.Module):
    """Routes rows by their values (`nonzero`: fake tensors cannot run it, so the forward runs
    for real), then sums them into a fp32 buffer in place: under autocast the linear's output
    is bf16, and `index_add_` refuses to mix them (DBRX's experts)."""

    def __init__(self, mixes: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.mixes = mixes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        rows = (x[:, 0] > -1e9).nonzero().squeeze(1)  # every row
        out = torch.zeros(x.shape[0], 8, device=x.device, dtype=None if self.mixes else h.dtype)
        return out.index_add_(0, rows, h[rows]).sum()


def test_a_forward_that_fails_only_under_autocast_is_not_blamed_on_the_batch() -> None:
    model = MixesUnderAutocast()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, 8)
    with pytest.raises(ValueError, match="raises under autocast to bfloat16") as info:
        autoshard.plan(
            model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="bf16"
        )
    message = str(info.value)
    assert "index_add_" in message and "mixed_precision='no'" in message
    assert "does not fit the model" not in message, message
    plan = autoshard.plan(
        model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="no"
    )
    assert plan.mixed_precision.value == "no"


def test_auto_mixed_precision_a_forward_raises_under_is_turned_off_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asked for nothing, a user whose model cannot run under autocast trains it as written
    (DBRX's experts on a GPU, where "auto" is bf16), told why; asked for bf16, they are refused
    as above. Auto is bf16 on any CPU here."""
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)
    model = MixesUnderAutocast()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, 8)
    plan = autoshard.plan(model, optimizer, batch, world_size=2, device_memory="1GiB")
    assert plan.mixed_precision.value == "no"
    reason = next(r for r in plan.reasons if r.startswith("mixed precision"))
    assert reason.startswith("mixed precision off (auto chose bf16)"), reason
    assert "raises under autocast to bfloat16 (RuntimeError: index_add_()" in reason, reason
    # measured without autocast (on real tensors: fake ones cannot run `nonzero`), as it trains
    assert any("activations were measured on real tensors" in r for r in plan.reasons)
    with pytest.raises(ValueError, match="raises under autocast to bfloat16"):
        autoshard.plan(
            model, optimizer, batch, world_size=2, device_memory="1GiB", mixed_precision="bf16"
        )


class MixesInPlace(nn.Module):
    """`MixesUnderAutocast` without the read-back: fake tensors run it, and `index_add_`'s fake
    kernel takes the bf16 source that the real one refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 8, device=x.device)
        rows = torch.arange(x.shape[0], device=x.device)
        return out.index_add_(0, rows, self.blocks[0](x)).sum()


@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
def test_a_source_autocast_makes_another_dtype_is_found_on_fake_tensors(
    on_meta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the plan chose bf16 for it: `prepare`'s trial step then raised the real kernel's
    error, and a what-if plan stood for a step that cannot run. Now auto turns mixed precision
    off and explicit bf16 is refused by the plan, before anything is wrapped; on meta too, where
    no real forward can tell (the step runs there without autocast)."""
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)
    with torch.device("meta" if on_meta else "cpu"):
        model = MixesInPlace()
        batch = torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    where = {"device": "cuda", "device_memory": "80GiB"} if on_meta else {"device_memory": "1GiB"}
    plan = autoshard.plan(model, optimizer, batch, world_size=2, **where)
    assert plan.mixed_precision.value == "no"
    reason = next(r for r in plan.reasons if r.startswith("mixed precision"))
    assert "raises under autocast to bfloat16" in reason and "index_add_()" in reason, reason
    assert not any("not simulated" in r for r in plan.reasons), plan.reasons
    with pytest.raises(ValueError, match="raises under autocast to bfloat16"):
        autoshard.plan(model, optimizer, batch, world_size=2, mixed_precision="bf16", **where)


def test_auto_mixed_precision_that_the_forward_runs_under_stays_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(facts, "_cpu_has_native_bf16", lambda: True)
    model = MixesUnderAutocast(mixes=False)  # sums into a buffer of autocast's dtype
    batch = torch.randn(4, 8)
    plan = autoshard.plan(
        model, torch.optim.AdamW(model.parameters()), batch, world_size=2, device_memory="1GiB"
    )
    assert plan.mixed_precision.value == "bf16"
    assert any(r.startswith("mixed precision bf16 (auto)") for r in plan.reasons)


class ReadsBack(nn.Module):
    """A forward that branches on a value of its tensors: fake and meta tensors have none."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        return h * 2 if h.sum() > 0 else h


def test_a_meta_model_whose_forward_reads_values_is_not_blamed_on_the_batch() -> None:
    """On meta, the forward run to tell a batch that does not fit from what fake tensors cannot
    run fails for the same reason as the fake trace: it says nothing of the batch. The error
    says what is wrong and what to do (transformers' Wav2Vec2 in training mode computes its
    time masks in numpy: planned on meta it was refused as a batch that did not fit)."""
    with torch.device("meta"):
        model = ReadsBack()
    batch = torch.randn(4, 8, device="meta")
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ValueError, match="the model is on the meta device, where its forward"
    ) as info:
        autoshard.plan(model, optimizer, batch, world_size=2, device_memory="1GiB")
    message = str(info.value)
    assert (
        "which needs real values" in message
        and "build the model and its batch on the CPU" in message
    )
    assert "(4, 8) float32" in message
    assert not message.startswith("example_batch does not fit the model"), message
    # built on the CPU, as the message says, it plans: its activations measured on real rows
    model = ReadsBack()
    plan = autoshard.plan(
        model,
        torch.optim.AdamW(model.parameters()),
        torch.randn(4, 8),
        world_size=2,
        device_memory="1GiB",
    )
    assert any("measured on real tensors" in r for r in plan.reasons), plan.reasons


class FailsOnFakeThenReadsBack(nn.Module):
    """A forward whose fake run fails for a reason of its own (switch_transformers casts a module
    in place, which fake parameters refuse) before it reads values back (`.item()` through a
    condition, or `.tolist()`): the meta forward then fails on the read-back, which says nothing
    of the batch either."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(x):
            raise RuntimeError("a step only fake tensors fail")
        h = self.blocks[0](x)
        if self.read == "item":
            return h * 2 if h.sum() > 0 else h
        return h * len(h[:, 0].tolist())


@pytest.mark.parametrize("read", ["item", "tolist"])
def test_a_meta_forward_that_asks_for_values_is_not_blamed_on_the_batch(read: str) -> None:
    """Before: 'example_batch does not fit the model' (Tensor.item() cannot be called on meta
    tensors), for DeepSeek-V2, Reformer and Switch Transformers planned on meta."""
    with torch.device("meta"):
        model = FailsOnFakeThenReadsBack(read)
    batch = torch.randn(4, 8, device="meta")
    with pytest.raises(ValueError, match="the model is on the meta device, where its forward"):
        autoshard.plan(
            model, torch.optim.AdamW(model.parameters()), batch, world_size=2, device_memory="1GiB"
        )


def test_the_simulation_leaves_no_rank_prefix_on_later_tracebacks() -> None:
    # init_process_group, even of the fake group the simulation uses, installs an excepthook
    # that prefixes every traceback line of the process with "[rank0]:"
    import sys

    hook = sys.excepthook
    model, optimizer, batch = make()
    autoshard.plan(model, optimizer, batch, world_size=2, device_memory="1GiB")
    assert sys.excepthook is hook


class ViewBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, :8]  # a view: FSDP2 warns about a wrapped module returning one


def test_the_simulation_keeps_fsdp2s_warnings_about_its_own_wrapping_to_itself() -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([ViewBlock(), ViewBlock()]))
    model.forward = lambda x: model[0][1](model[0][0](x))  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, optimizer, torch.randn(4, 8), world_size=2)
    assert any("simulated steps" in r for r in plan.reasons), plan.reasons  # FSDP2 did run
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
