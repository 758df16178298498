"""`autoshard._torch_compat`: every private torch name the package uses resolves on this torch,
a missing one is named with the feature that needs it, no other module reaches one, and every
patch of torch is undone on every way out (issue 13)."""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import pathlib
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from autoshard import _torch_compat as compat
from autoshard.measure import fake, workspace
from autoshard.measure.answers import finding
from autoshard.measure.quiet import own_runs_quiet

PACKAGE = pathlib.Path(compat.__file__).parent

# ---------------------------------------------------------------------------------------------
# Each symbol, present here; absent, named


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_symbol_resolves_on_this_torch(name: str) -> None:
    assert compat.resolve(name) is not None  # a missing one raises with the message below


def _remove(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make `path` ("module:attr.attr") absent for the duration of the test."""
    module_name, _, attrs = path.partition(":")
    *owners, last = [module_name.split(".")[-1], *attrs.split(".")]
    parent: Any = importlib.import_module(module_name)
    chain = [parent]
    for attr in owners[1:]:
        chain.append(getattr(chain[-1], attr))
    owner = chain[-1]
    try:
        monkeypatch.delattr(owner, last)
    except TypeError:  # a type of torch's C extension, immutable: its owner's name goes instead
        pass
    if hasattr(owner, last) and len(chain) > 1:  # created again on access (torch.ops namespaces)
        monkeypatch.setattr(chain[-2], owners[-1], types.SimpleNamespace())


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_a_missing_symbol_is_named_with_its_use_and_the_torch_version(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    symbol = compat.SYMBOLS[name]
    _remove(monkeypatch, symbol.path)
    expected = (
        f"autoshard needs {symbol.dotted} for {symbol.used_for}; this torch "
        f"{torch.__version__} lacks it"
    )
    with pytest.raises(compat.MissingTorchSymbol, match=re.escape(expected)):
        compat.resolve(name)
    assert compat.missing(name) is not None and compat.missing(name).startswith(expected)  # type: ignore[union-attr]


def test_package_errors_name_the_missing_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    version = torch.__version__
    fake_pg = importlib.import_module("torch.testing._internal.distributed.fake_pg")
    monkeypatch.delattr(fake_pg, "FakeStore")
    assert fake.unavailable() == (
        f"torch {version} lacks the memory trackers (autoshard needs "
        f"torch.testing._internal.distributed.fake_pg.FakeStore for simulating any world size "
        f"(the fake process group); this torch {version} lacks it (AttributeError: module "
        f"'torch.testing._internal.distributed.fake_pg' has no attribute 'FakeStore'))"
    )


def test_cpu_workspace_is_skipped_with_the_reason_without_the_profiler_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert workspace.why_not(torch.device("cpu")) is None
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    reason = workspace.why_not(torch.device("cpu"))
    assert reason is not None and reason.startswith(
        f"autoshard needs torch.autograd.profiler._is_profiler_enabled for measuring CPU kernel "
        f"workspace; this torch {torch.__version__} lacks it"
    )


def test_graceful_without_onednn_and_without_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = list(compat.resolve("op_implementations_checks"))
    monkeypatch.setattr(torch, "ops", types.SimpleNamespace(aten=object(), mkldnn=object()))
    assert compat.cpu_has_native_bf16() is False
    assert compat.grouped_mm() is None
    with fake.wider_fake_kernels("cpu"):  # nothing to widen but what masks of one value find
        widened = compat.resolve("op_implementations_checks")
        assert len(widened) == len(checks) + len(finding(())) and widened[-len(checks) :] == checks


def test_flop_formulas_a_raw_one_gets_the_operators_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils import flop_counter

    assert torch.ops.aten.mm in compat.flop_formulas()
    assert sorted(compat.sdpa_flop_ops().values()) == [False] * 4 + [True] * 4  # CPU kernel too
    seen: list[type] = []

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        seen.append(type(args[0]))
        return 7

    raw = {torch.ops.aten.mm: compat.raw_flop_formula(formula)}
    with flop_counter.FlopCounterMode(display=False, custom_mapping=raw) as counter:
        torch.mm(torch.ones(2, 3), torch.ones(3, 4))
    assert seen == [torch.Tensor] and counter.get_total_flops() == 7  # not shapes: tensors
    monkeypatch.delattr(flop_counter, "flop_registry")
    assert compat.flop_formulas() == {}  # graceful: torch's formulas then count unguarded


# ---------------------------------------------------------------------------------------------
# Private fields of torch objects (not importable names): present on this torch


def test_private_fields_of_torch_objects_are_there() -> None:
    base, other = torch.zeros(3), torch.zeros(3)
    key = compat.storage_key(base.untyped_storage())
    assert key == compat.storage_key(base[1:].untyped_storage())  # a view: the same storage
    assert key != compat.storage_key(other.untyped_storage())
    data = list(range(4))
    assert compat.sampler_num_samples(torch.utils.data.RandomSampler(data)) is None
    assert compat.sampler_num_samples(torch.utils.data.RandomSampler(data, num_samples=2)) == 2
    parent = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1))
    compat.keep_children(parent, 2)
    assert [type(m) for m in parent] == [nn.Linear, nn.ReLU]
    assert compat.is_batch_norm(nn.BatchNorm1d(2)) and not compat.is_batch_norm(nn.Linear(1, 1))
    _, mem_tracker = compat.mem_trackers()
    tracker = mem_tracker()
    assert hasattr(compat.resolve("_MemRefType"), "GRAD")
    for field in (
        *compat._PEAK_FIELDS,
        "_track_module_params_and_buffers",
        "_param_to_grad_hook_handles",
        "_update_and_maybe_create_winfos",
    ):
        assert hasattr(tracker, field), f"torch {torch.__version__}'s MemTracker lacks {field}"
    assert compat.allocation_tag() is not None
    assert isinstance(compat.profiler_enabled(), bool)


@contextlib.contextmanager
def _one_rank_group(backend: str) -> Iterator[Any]:
    """A process group of one rank ("fake", or "gloo" where collectives must move data) and
    its CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    store = compat.fake_store() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, rank=0, world_size=1, store=store)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_param_groups_have_pluggable_comms_and_the_default_group_a_store() -> None:
    from torch.distributed.fsdp import fully_shard

    with _one_rank_group("fake") as mesh:
        assert compat.default_group() is not None and compat.default_store() is not None
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(module, mesh=mesh)
        groups = compat.fsdp_param_groups(module)
        assert groups, "FSDP2 state has neither _fsdp_param_groups nor _fsdp_param_group"
        assert compat.has_pluggable_comms(groups)


# ---------------------------------------------------------------------------------------------
# Patches of torch, undone on every path


class _Refused(Exception):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise _Refused


def test_resize_hook_sees_each_resize_and_is_undone_on_exit_and_when_it_fails() -> None:
    original = torch.UntypedStorage.resize_
    storage = torch.zeros(0, dtype=torch.uint8).untyped_storage()
    seen: list[int] = []
    with compat.storage_resize_hook(lambda s: seen.append(s.nbytes())):
        storage.resize_(64)
        storage.resize_(0)
    assert seen == [64, 0] and torch.UntypedStorage.resize_ is original
    with pytest.raises(_Refused), compat.storage_resize_hook(_refuse):
        storage.resize_(8)  # the hook itself fails
    assert torch.UntypedStorage.resize_ is original
    with pytest.raises(_Refused), compat.storage_resize_hook(len), _FailingMode():
        pass
    assert torch.UntypedStorage.resize_ is original
    # LiveBytes' own failures are in tests/test_meter.py


class _FailingMode:
    def __enter__(self) -> None:
        raise _Refused

    def __exit__(self, *exc: Any) -> None:
        pass


def test_fake_kernel_removed_when_the_enclosing_mode_fails_or_the_body_raises() -> None:
    checks = compat.resolve("op_implementations_checks")
    before = list(checks)
    with fake.wider_fake_kernels("cpu"):  # _grouped_mm's, oneDNN's LSTM layer's, nonzero's...
        widened = 1 + (fake.mkldnn_rnn() is not None) + len(finding(()))
        assert len(checks) == len(before) + widened
    assert checks == before
    with pytest.raises(_Refused), fake.wider_fake_kernels("cpu"), _FailingMode():
        pass
    assert checks == before
    with pytest.raises(_Refused), fake.wider_fake_kernels("cpu"):
        _refuse()
    assert checks == before


def _groups(n: int) -> list[Any]:
    return [
        types.SimpleNamespace(_all_gather_comm=f"ag{i}", _reduce_scatter_comm=f"rs{i}")
        for i in range(n)
    ]


def test_fsdp_comms_put_back_when_wrapping_fails_part_way_or_the_body_raises() -> None:
    groups = _groups(3)
    made: list[Any] = []

    def wrap_twice(comm: Any) -> Any:
        if len(made) == 3:  # the second group's reduce-scatter
            raise _Refused
        made.append(comm)
        return ("wrapped", comm)

    with pytest.raises(_Refused), compat.fsdp_comms_wrapped(groups, wrap_twice):
        pass
    assert [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups] == [
        (f"ag{i}", f"rs{i}") for i in range(3)
    ]
    with pytest.raises(_Refused), compat.fsdp_comms_wrapped(groups, lambda c: ("w", c)) as ok:
        assert ok and groups[2]._reduce_scatter_comm == ("w", "rs2")
        _refuse()
    assert groups[2]._reduce_scatter_comm == "rs2"
    without = [types.SimpleNamespace()]
    with compat.fsdp_comms_wrapped(without, _refuse) as ok:
        assert ok is False


def test_quiet_runs_put_the_logger_and_excepthook_back_on_error() -> None:
    import logging

    logger = logging.getLogger(compat.FAKE_TENSOR_LOGGER)
    filters = list(logger.filters)
    hook = sys.excepthook
    with pytest.raises(_Refused), own_runs_quiet():
        sys.excepthook = _refuse
        assert len(logger.filters) == len(filters) + 1
        _refuse()
    assert logger.filters == filters and sys.excepthook is hook


# ---------------------------------------------------------------------------------------------
# No module but _torch_compat reaches a private torch name

# Private attributes of objects other than torch's, reached by name (transformers' models)
NOT_TORCH = frozenset({"_no_split_modules", "_gradient_checkpointing_func"})
_TORCH_PRIVATE_PATH = re.compile(r"^torch(\.\w+)*\._[A-Za-z]")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(sources: list[str]) -> set[str]:
    """Private names autoshard defines itself (functions, classes, variables, self attributes):
    reaching those on another object is not reaching torch."""
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and _on_self(node):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def private_torch_uses(source: str, own: set[str]) -> list[str]:
    """Each private torch name `source` reaches: an import from a private torch module or of a
    private name, a private attribute of anything but autoshard's own objects, a "torch._x"
    dotted path in a string, a private name given to getattr/hasattr/setattr/delattr."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(map(_private, parts)):
                found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{line}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _on_self(node):
            if node.attr not in own:
                found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _TORCH_PRIVATE_PATH.match(node.value):
                found.append(f"{line}: {node.value!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            by_name = node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            if by_name and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if isinstance(name, str) and _private(name) and name not in own | NOT_TORCH:
                    found.append(f"{line}: {node.func.id}(..., {name!r})")
    return found


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_torch_compat.py"
    }


def test_no_module_but_torch_compat_reaches_a_private_torch_name() -> None:
    sources = _sources()
    own = _own_private_names(list(sources.values()))
    found = {
        name: uses for name, source in sources.items() if (uses := private_torch_uses(source, own))
    }
    assert found == {}, f"private torch names outside autoshard/_torch_compat.py: {found}"


@pytest.mark.parametrize(
    "line",
    [
        "from torch.utils._pytree import tree_map",
        "import torch.testing._internal.distributed.fake_pg",
        "from torch.distributed.distributed_c10d import _get_default_group",
        "x = torch.ops.aten._grouped_mm.default",
        "y = module._get_fsdp_state()",
        "z = getattr(state, '_fsdp_param_group', None)",
        "LOGGER = 'torch._subclasses.fake_tensor'",
    ],
)
def test_the_scan_finds_a_private_torch_name_added_to_a_module(line: str) -> None:
    sources = _sources()
    own = _own_private_names(list(sources.values()))
    plan = sources[str(pathlib.Path("autoshard", "decide", "plan.py"))]
    assert private_torch_uses(plan, own) == []
    assert private_torch_uses(f"{plan}\n{line}\n", own) != []


# ---------------------------------------------------------------------------------------------
# FSDP2 after an aborted step: reset_iter_state (torch 2.13 on) or its steps on the private
# fields of torch 2.11 and 2.12, on one gloo rank


class _Aborted(Exception):
    pass


def _sharded(model: nn.Sequential, mesh: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step_grads(model: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
    params = list(model.parameters())  # the sharded ones, as an optimizer holds them
    model(batch).square().sum().backward()
    grads = [p.grad.full_tensor().clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    return grads


def _abort_once(model: nn.Sequential, where: str) -> None:
    """One step that raises in block 1: at its forward, or inside its backward after its second
    linear layer's gradients were accumulated (its post-backward never runs)."""

    def fail(*args: Any) -> None:
        raise _Aborted

    block = model[1]
    handle = (
        block.register_forward_pre_hook(fail)
        if where == "forward"
        else block[0].register_full_backward_hook(fail)
    )
    params = list(model.parameters())
    with pytest.raises(_Aborted):
        model(torch.ones(4, 8)).square().sum().backward()
    handle.remove()
    for p in params:  # what the trial's optimizer.zero_grad clears: the sharded parameters only
        p.grad = None


@pytest.mark.parametrize("route", ["this_torch", "fields"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fsdp2_trains_as_new_after_an_aborted_step_and_a_reset(
    monkeypatch: pytest.MonkeyPatch, where: str, route: str
) -> None:
    from torch.distributed.fsdp import FSDPModule

    public = hasattr(FSDPModule, "reset_iter_state")
    if route == "fields" and public:  # the route of torch 2.11 and 2.12, taken here
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3)]
    base = nn.Sequential(*blocks)
    batch = torch.randn(4, 8)
    with _one_rank_group("gloo") as mesh:
        expected = _step_grads(_sharded(copy.deepcopy(base), mesh), batch)
        model = _sharded(copy.deepcopy(base), mesh)
        _abort_once(model, where)
        reset = compat.fsdp_reset_iter_state(model)
        if not reset and route == "fields" and public:
            pytest.skip(f"torch {torch.__version__} renamed FSDP2's fields; its own reset serves")
        assert reset, f"torch {torch.__version__} has neither reset_iter_state nor its fields"
        for group in compat.fsdp_param_groups(model[1]):
            assert group.is_sharded and group._training_state.name == "IDLE"
        got = _step_grads(model, batch)
    # A gradient the aborted backward left on an unsharded parameter would be added (torch
    # 2.13's reset_iter_state keeps it; fsdp_reset_iter_state drops it).
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_fsdp2_reset_changes_nothing_and_says_so_without_its_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    torch.manual_seed(0)
    with _one_rank_group("gloo") as mesh:
        model = _sharded(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), mesh)
        model[1].register_forward_pre_hook(_refuse)  # after FSDP2's own: block 1 is gathered
        with pytest.raises(_Refused):
            model(torch.ones(2, 8))
        group = compat.fsdp_param_groups(model[1])[0]
        monkeypatch.delattr(group, "_post_forward_indices")
        assert compat.fsdp_reset_iter_state(model) is False
        assert group._training_state.name == "FORWARD" and not group.is_sharded
