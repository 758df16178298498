"""autoshard's on-disk cache of fake steps (`autoshard.measure.cache`, issue 24): a plan made
again reads its trace and simulations back instead of running them, what they depend on changes
their names, and a cache that cannot be used is no cache at all, never an error."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import sys
import threading
import types
from collections import UserDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import launch
from torch import nn

import autoshard
from autoshard.measure import cache, facts, simulate


class Net(nn.Module):
    def __init__(self, width: int = 16, p: float = 0.0, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Dropout(p)) for _ in range(2)
        )
        self.head = nn.Linear(width, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return self.head(x).float().logsumexp(-1).mean()


def _tokens(rows: int = 4, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.randint(32, (rows, 8), generator=torch.Generator().manual_seed(0)).to(dtype)


def _plan(model: nn.Module | None = None, batch: Any = None, **kw: Any) -> autoshard.Plan:
    model = model or Net()
    optimizer = kw.pop("optimizer", None) or torch.optim.AdamW(model.parameters())
    options: dict[str, Any] = {
        "world_size": 2,
        "mixed_precision": "no",
        "device_memory": "4GiB",  # not the host memory free now, which moves
        **kw,
    }
    return autoshard.plan(model, optimizer, _tokens() if batch is None else batch, **options)


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a directory of this test's own."""
    monkeypatch.setenv("AUTOSHARD_CACHE", "1")
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _forbid_fake_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a fake step ran although the cache had it")

    monkeypatch.setattr(simulate, "simulate", refuse)
    monkeypatch.setattr(facts, "_measure", refuse)


def _figures(plan: autoshard.Plan) -> dict[str, Any]:
    return {k: v for k, v in plan.to_dict().items() if k != "reasons"}


def test_a_plan_made_again_reads_every_fake_step_back(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _plan(strategy="full_shard", activation_checkpointing=True)
    assert not any("cache" in r for r in first.reasons), first.reasons
    written = sorted(p.relative_to(kept).parts[0] for p in kept.rglob("*.json"))
    assert written == ["run", "run", "trace"]  # FULL_SHARD plain and checkpointed; the trace

    _forbid_fake_steps(monkeypatch)
    again = _plan(strategy="full_shard", activation_checkpointing=True)
    assert _figures(again) == _figures(first)
    text = " ".join(again.reasons)
    assert f"2 read from autoshard's cache: {kept}" in text, text
    assert f"(read from autoshard's cache: {kept})" in text, text


def test_only_the_runs_not_kept_are_simulated(kept: Path) -> None:
    _plan(strategy="ddp")
    both = _plan(strategy="auto")  # DDP is kept, the sharded ones are not
    text = " ".join(both.reasons)
    assert "1 read from autoshard's cache" in text, text
    assert len(list((kept / "run").glob("*.json"))) >= 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="what-if planning for CUDA without a GPU")
def test_what_the_simulation_left_out_is_said_again(kept: Path) -> None:
    """A what-if plan for GPUs made without one cannot measure the convolution's workspace
    (forward and backward) nor the reductions' (the loss's mean, the linear layer's bias
    gradient, a sum): 4 calls; the plan read back says so too."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 4))
    options = {"device": "cuda", "device_memory": "80GiB", "strategy": "ddp"}
    batch = torch.randn(2, 3, 8, 8)
    notes = []
    for _ in range(2):
        plan = _plan(model, batch, loss_fn=lambda out, batch: out.float().mean(), **options)
        notes.append(next(r for r in plan.reasons if "simulated steps" in r))
    assert "cache" not in notes[0] and "1 read from autoshard's cache" in notes[1]
    for note in notes:
        assert "kernel workspace of 4 distinct" in note and "no CUDA device here" in note, note


def _digests(*args: Any, **kw: Any) -> tuple[str, str]:
    """The names the trace and the DDP run are looked up by, for a plan of these arguments."""
    names: dict[str, str] = {}
    original = cache.load

    def spy(kind: str, digest: str, decode: Any) -> Any:
        names.setdefault(kind, digest)
        return original(kind, digest, decode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache, "load", spy)
        _plan(*args, strategy="ddp", **kw)
    return names["trace"], names["run"]


def _frozen() -> dict[str, Any]:
    model = Net()
    model.embed.requires_grad_(False)
    return {"model": model, "optimizer": torch.optim.AdamW(model.blocks.parameters())}


def _changed_torch(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setattr(cache, "_context", functools.cache(cache._context.__wrapped__))
    return {}


def _changed_environment(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return {}


def _changed_attention(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """As torch.backends.cuda.enable_flash_sdp(False) would leave it, for this test only."""
    enabled = torch.backends.cuda.flash_sdp_enabled()
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: not enabled)
    return {}


def _regrouped() -> dict[str, Any]:
    """The same hyperparameters in two groups, the parameters in the other one."""
    model = Net()
    first, second = model.blocks[0].parameters(), model.blocks[1].parameters()
    rest = [*model.embed.parameters(), *model.head.parameters()]
    groups = [{"params": [*second, *rest], "amsgrad": True}, {"params": [*first]}]
    return {"model": model, "optimizer": torch.optim.AdamW(groups)}


CHANGES: dict[str, Any] = {
    "a wider layer": lambda mp: {"model": Net(width=24)},
    "a dropout rate": lambda mp: {"model": Net(p=0.1)},
    "eval mode": lambda mp: {"model": Net().eval()},
    "tied weights": lambda mp: {"model": Net(tied=True)},
    "a frozen layer": lambda mp: _frozen(),
    "more rows": lambda mp: {"batch": _tokens(rows=6)},
    "another dtype": lambda mp: {"batch": _tokens(dtype=torch.int32)},
    "bf16": lambda mp: {"mixed_precision": "bf16"},
    "another loss": lambda mp: {"loss_fn": lambda out, batch: out * 2},
    "torch": _changed_torch,
    "a kernel setting": _changed_environment,
    "an attention kernel switched off": _changed_attention,
    "the default dtype": None,  # its own case: torch's setting itself, put back after
    "optimizer groups": lambda mp: _regrouped(),
    "a mapping's rows": lambda mp: {"batch": _Encoding(tokens=_tokens(rows=6))},
}


class _Encoding(UserDict):  # type: ignore[type-arg]
    """What a tokenizer returns (transformers' BatchEncoding is a UserDict): no pytree node."""


@pytest.mark.parametrize("change", list(CHANGES))
def test_what_a_fake_step_depends_on_renames_it(
    change: str, kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if change == "optimizer groups":  # its own baseline: two groups, as in the change
        model = Net()
        first, second = model.blocks[0].parameters(), model.blocks[1].parameters()
        rest = [*model.embed.parameters(), *model.head.parameters()]
        groups = [{"params": [*first, *rest], "amsgrad": True}, {"params": [*second]}]
        before = _digests(model, optimizer=torch.optim.AdamW(groups))
        after = _digests(**_regrouped())
        assert after[0] == before[0] and after[1] != before[1]  # the trace has no optimizer
        return
    if change == "the default dtype":
        # Set for real, not by patching torch.get_default_dtype: torch's fake-tensor dispatch
        # cache (one per process) keys its entries by what that function returns, and entries
        # made under a patched answer served float32 results to a later float64 plan
        model = Net()  # its parameters fp32: only the setting differs
        before = _digests(model)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            after = _digests(model)
        finally:
            torch.set_default_dtype(dtype)
        assert after[0] != before[0] and after[1] != before[1]
        return
    if change == "a mapping's rows":
        before = _digests(batch=_Encoding(tokens=_tokens()))
        after = _digests(batch=_Encoding(tokens=_tokens(rows=6)))
        assert after[0] != before[0] and after[1] != before[1]
        return
    before = _digests()
    assert _digests() == before  # the same plan again: the same names
    options = CHANGES[change](monkeypatch)
    after = _digests(options.pop("model", None), options.pop("batch", None), **options)
    assert after[0] != before[0] and after[1] != before[1]


def test_an_optimizer_setting_renames_the_runs_only(kept: Path) -> None:
    model = Net()
    trace, run = _digests(model, optimizer=torch.optim.AdamW(model.parameters(), foreach=False))
    model = Net()
    foreach = _digests(model, optimizer=torch.optim.AdamW(model.parameters(), foreach=True))
    assert foreach[0] == trace and foreach[1] != run


class _OwnParameter(torch.nn.Parameter):
    pass


def test_a_parameter_of_another_class_renames_the_runs(kept: Path) -> None:
    """torch's optimizers step a Parameter subclass another way (not foreach on CUDA)."""
    model = Net()
    before = _digests(model, optimizer=torch.optim.AdamW(model.parameters()))
    model = Net()
    model.embed.weight = _OwnParameter(model.embed.weight.detach())
    after = _digests(model, optimizer=torch.optim.AdamW(model.parameters()))
    assert after[1] != before[1]


def test_an_edit_to_the_models_source_renames_it(
    kept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "user_model.py"
    text = (
        "import torch\n"
        "class Scaled(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return (self.layer(x) * SCALE).sum()\n"
        "SCALE = 1\n"
    )
    source.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("user_model")
    batch = torch.randn(4, 8)
    before = _digests(module.Scaled(), batch)
    source.write_text(text.replace("SCALE = 1", "SCALE = 2  # edited"))
    module = importlib.reload(module)
    assert _digests(module.Scaled(), batch) != before
    sys.modules.pop("user_model")


def test_the_same_global_name_in_a_base_class_s_module_is_read_there(
    kept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subclass in one file, its base in another, each file with its own `FLAG`: the base's
    forward reads the base's."""
    (tmp_path / "user_base.py").write_text(
        "import torch\n"
        "FLAG = 1\n"
        "class Base(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.layer(x).repeat(1, FLAG).sum()\n"
    )
    (tmp_path / "user_sub.py").write_text(
        "from user_base import Base\n"
        "FLAG = 1\n"
        "class Sub(Base):\n"
        "    def extra(self):\n"
        "        return FLAG\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        base, sub = importlib.import_module("user_base"), importlib.import_module("user_sub")
        batch = torch.randn(4, 8)
        before = _digests(sub.Sub(), batch)
        monkeypatch.setattr(base, "FLAG", 8)
        assert _digests(sub.Sub(), batch) != before
    finally:
        sys.modules.pop("user_base")
        sys.modules.pop("user_sub")


def test_an_edit_to_a_module_the_forward_calls_into_renames_it(
    kept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper in another file of the program's own, reached as `helpers.act(x)`: covered by
    that file's contents (the model's own file is the same before and after)."""
    (tmp_path / "user_helpers.py").write_text("def act(x):\n    return x.tanh()\n")
    (tmp_path / "user_caller.py").write_text(
        "import torch\n"
        "import user_helpers\n"
        "class Calling(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return user_helpers.act(self.layer(x)).sum()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers = importlib.import_module("user_helpers")
    module = importlib.import_module("user_caller")
    batch = torch.randn(4, 8)
    try:
        before = _digests(module.Calling(), batch)
        (tmp_path / "user_helpers.py").write_text("def act(x):\n    return x.tanh() * 2\n")
        importlib.reload(helpers)
        edited = _digests(module.Calling(), batch)
        assert edited != before
        helpers.SCALE = 2  # a setting a script keeps in a module of its own: `cfg.X = args.x`
        assert _digests(module.Calling(), batch) != edited
    finally:
        sys.modules.pop("user_helpers")
        sys.modules.pop("user_caller")


def test_cache_off_writes_nothing(kept: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_CACHE", "off")
    plan = _plan()
    assert not kept.exists()
    assert not any("cache" in r for r in plan.reasons)


def test_unreadable_entries_are_simulated_again_and_replaced(kept: Path) -> None:
    first = _plan(strategy="ddp")
    entries = sorted(kept.rglob("*.json"))
    entries[0].write_text("{ not json")
    entries[1].write_text(json.dumps({"format": cache.FORMAT, "value": {"backward": 1}}))
    again = _plan(strategy="ddp")
    assert _figures(again) == _figures(first)
    assert not any("cache" in r for r in again.reasons), again.reasons
    for entry in entries:
        assert json.loads(entry.read_text())["format"] == cache.FORMAT  # written afresh


def test_a_directory_that_cannot_be_written_is_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("mine")
    monkeypatch.setenv("AUTOSHARD_CACHE", "1")
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(blocker / "cache"))
    plan = _plan()
    assert plan.strategy is not None
    assert blocker.read_text() == "mine"


def test_nothing_else_in_the_directory_is_touched(kept: Path) -> None:
    (kept / "run").mkdir(parents=True)
    mine = kept / "run" / "notes.txt"
    mine.write_text("mine")
    _plan()
    _plan()
    assert mine.read_text() == "mine"
    assert not list(kept.rglob("*.tmp"))


@functools.cache
def _job(out: Path) -> Any:
    return launch("cache", out)


@pytest.mark.slow
def test_in_a_job_what_one_rank_kept_serves_both(tmp_path: Path) -> None:
    """Rank 0 has every run kept, rank 1 none: neither simulates, both decide alike."""
    job = _job(tmp_path / "job")
    first, again = job.case("first"), job.case("again")
    for rank in (0, 1):
        assert again[rank]["figures"] == first[0]["figures"]
        assert "read from autoshard's cache" not in first[rank]["simulated"]
        assert "2 read from autoshard's cache" in again[rank]["simulated"]
    assert again[0]["trace_kept"] and not again[1]["trace_kept"]  # a trace is each rank's own


# ---------------------------------------------------------------------------------------------
# What the first version's key left out (a review found each by a stale estimate)


class _Conv(nn.Module):
    def __init__(self, stride: int = 1, act: Any = F.relu) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=stride, padding=1)
        self.act = act  # a callable attribute, chosen by the caller

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x)).float().mean()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({}, {"stride": 2}),  # a tuple attribute: one weight shape, a quarter of the output
        ({}, {"act": F.gelu}),
        ({"act": functools.partial(F.leaky_relu, negative_slope=0.1)}, {"act": F.relu}),
    ],
    ids=["conv stride", "activation", "partial"],
)
def test_module_attributes_beyond_numbers_rename_it(
    before: dict[str, Any], after: dict[str, Any], kept: Path
) -> None:
    batch = torch.randn(4, 3, 16, 16)
    assert _digests(_Conv(**before), batch) != _digests(_Conv(**after), batch)


@dataclass
class _Settings:
    """What a model keeps of its arguments (torchtitan's `model_args`, Meta's `params`)."""

    wide: bool = False
    dtype: torch.dtype = torch.float32


class _Configured(nn.Module):
    """A forward that reads its settings from attributes that are neither numbers nor
    callables: a dataclass, a dtype, a tensor."""

    def __init__(self, settings: _Settings | None = None, dtype: Any = torch.float32) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.settings = settings or _Settings()
        self.compute_dtype = dtype
        self.scale = torch.ones(8)  # a plain tensor attribute, no buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x.to(self.compute_dtype).float() * self.scale)
        if self.settings.wide:  # keeps an activation 8 times its input's for backward
            y = torch.relu(y.repeat(1, 8)).view(x.shape[0], 8, 8).mean(1)
        return y.to(self.settings.dtype).float().sum()


@pytest.mark.parametrize(
    "after",
    [
        {"settings": _Settings(wide=True)},
        {"settings": _Settings(dtype=torch.bfloat16)},
        {"dtype": torch.bfloat16},
    ],
    ids=["a dataclass's flag", "a dtype in a dataclass", "a dtype attribute"],
)
def test_settings_a_module_keeps_in_objects_rename_it(after: dict[str, Any], kept: Path) -> None:
    batch = torch.randn(4, 8)
    before = _digests(_Configured(), batch)
    assert _digests(_Configured(), batch) == before  # the same again: the same names
    assert _digests(_Configured(**after), batch) != before


def test_a_tensor_attribute_of_another_shape_renames_it(kept: Path) -> None:
    batch, other = torch.randn(4, 8), _Configured()
    other.scale = torch.ones(1, 8)
    assert _digests(other, batch)[0] != _digests(_Configured(), batch)[0]


def test_a_module_holding_what_cannot_be_described_is_planned_without_the_cache(
    kept: Path,
) -> None:
    model = _Configured()
    model.lock = threading.Lock()  # type: ignore[assignment]
    for _ in range(2):
        plan = _plan(model, torch.randn(4, 8), strategy="ddp")
        assert plan.strategy is not None
        assert not any("read from autoshard's cache" in r for r in plan.reasons), plan.reasons
    assert not kept.exists() or not any(kept.rglob("*.json"))


def test_a_batch_in_channels_last_renames_it(kept: Path) -> None:
    batch = torch.randn(4, 3, 16, 16)
    last = batch.to(memory_format=torch.channels_last)
    assert _digests(_Conv(), batch) != _digests(_Conv(), last)


def test_transformers_attention_implementation_renames_it(kept: Path) -> None:
    """`config.to_dict()` leaves the attention implementation out; eager attention keeps the
    scores, SDPA does not."""
    transformers = pytest.importorskip("transformers")
    names = []
    for implementation in ("sdpa", "eager"):
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            attn_implementation=implementation,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        batch = {"input_ids": _tokens() % 64, "labels": _tokens() % 64}
        names.append(_digests(model, batch))
    assert names[0][0] != names[1][0] and names[0][1] != names[1][1]


class _ReadsValues(nn.Module):
    """A forward that branches on its input's values: fake tensors cannot run it, so its trace
    is measured on real tensors, and depends on the batch's values."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0).any()):
            x = x * 2
        return self.layer(x).sum()


def test_a_trace_measured_on_real_values_is_not_kept(kept: Path) -> None:
    plan = _plan(_ReadsValues(), torch.randn(4, 8), strategy="ddp")
    assert any("could not be traced on fake tensors" in r for r in plan.reasons), plan.reasons
    assert not (kept / "trace").exists()
    again = _plan(_ReadsValues(), -torch.ones(4, 8), strategy="ddp")
    assert not any(
        "read from autoshard's cache:" in r and "activations" in r for r in again.reasons
    )


def test_objects_it_cannot_describe_plan_without_the_cache(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class of a __main__ without a file (a notebook) and a loss object holding arbitrary
    state: planned as before, never an error."""
    notebook = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    Defined = type("Defined", (Net,), {"__module__": "__main__"})

    class Loss:
        def __init__(self) -> None:
            self.args = object()  # argparse.Namespace and the like

        def __call__(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
            return out

    for _ in range(2):
        plan = _plan(Defined(), loss_fn=Loss(), strategy="ddp")
        assert plan.strategy is not None


def test_kept_values_read_back_as_they_were(kept: Path) -> None:
    from autoshard.measure.trace import profile_step

    model = Net()
    profile = profile_step(model, list(model.blocks), _tokens(), None, None)
    for value in (profile, replace(profile, unlike_blocks="blocks 2 and 3 run different ops")):
        assert cache.profile_from_json(json.loads(json.dumps(cache.profile_to_json(value)))) == (
            value
        )
    _plan(strategy="full_shard", activation_checkpointing=True)
    for entry in (kept / "run").glob("*.json"):
        value = json.loads(entry.read_text())["value"]["simulated"]
        assert cache.simulated_to_json(cache.simulated_from_json(value)) == value


def test_an_entry_of_the_wrong_types_is_not_read(kept: Path) -> None:
    first = _plan(strategy="ddp")
    (entry,) = (kept / "run").glob("*.json")
    whole = json.loads(entry.read_text())
    whole["value"]["simulated"]["backward"]["params"] = "12"
    entry.write_text(json.dumps(whole))
    again = _plan(strategy="ddp")
    assert _figures(again) == _figures(first)
    assert not any("1 read from autoshard's cache" in r for r in again.reasons)


# Read by `_Switched.forward` and `_switched_loss` from this module, as a script's flags are
WIDEN = 1
SCALE = 1.0
CLAMP = 10.0
LOG = logging.getLogger("autoshard.test")


def _widened(x: torch.Tensor) -> torch.Tensor:
    return x.repeat(1, WIDEN)  # a helper reading a global in turn


class _Switched(nn.Module):
    """A forward whose work depends on module-level values its source file does not change."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOG.debug("forward")  # a logger: by its name
        return _widened(self.layer(self.clamped(x))).square().sum()

    @torch.no_grad()  # torch's wrapper: what it wraps is read
    def clamped(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-CLAMP, CLAMP)


def _switched_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out * SCALE


def test_a_global_the_forward_or_the_loss_reads_renames_it(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that sets a flag from its arguments, or loops over variants, runs another
    forward from the same source file: with the flag left out of the names, the second plan read
    the first one's fake steps back (the estimate of another model)."""
    batch = torch.randn(4, 8)
    plain = _digests(_Switched(), batch)
    assert _digests(_Switched(), batch) == plain  # the logger does not stop the cache

    narrow = _plan(_Switched(), batch, strategy="ddp")
    monkeypatch.setattr(sys.modules[__name__], "WIDEN", 64)  # read by the helper forward calls
    wide = _plan(_Switched(), batch, strategy="ddp")
    assert not any("read from autoshard's cache" in r for r in wide.reasons), wide.reasons
    assert wide.chosen.footprint.activations > narrow.chosen.footprint.activations
    widened = _digests(_Switched(), batch)
    assert widened[0] != plain[0] and widened[1] != plain[1]

    loss = _digests(_Switched(), batch, loss_fn=_switched_loss)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 2.0)
    assert _digests(_Switched(), batch, loss_fn=_switched_loss) != loss

    clamped = _digests(_Switched(), batch)
    monkeypatch.setattr(sys.modules[__name__], "CLAMP", 1.0)
    assert _digests(_Switched(), batch) != clamped


encoder = threading.Lock()  # a global of the name a forward reads as an attribute


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Switched()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


LOCKED = threading.Lock()


class _Locking(_Switched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with LOCKED:  # a global that cannot be described: by its class, as before
            return super().forward(x)


def test_a_global_that_cannot_be_described_keeps_the_cache(kept: Path) -> None:
    for _ in range(2):
        plan = _plan(_Locking(), torch.randn(4, 8), strategy="ddp")
    assert any("read from autoshard's cache" in r for r in plan.reasons), plan.reasons


def test_a_key_that_is_a_function_is_named_by_its_code() -> None:
    """A `repr` holds the function's address: another process would name it otherwise."""
    text = json.dumps(cache._attribute({_widened: 1}))
    assert "0x" not in text and "_widened" in text


def test_installed_packages_are_left_to_their_versions() -> None:
    import pynvml  # noqa: F401 - installed as nvidia-ml-py: its import name is not its package's

    assert not cache._own_code("pynvml") and not cache._own_code("json")
    assert cache._own_code(__name__)


def test_an_attribute_named_as_a_global_is_not_read_as_it(kept: Path) -> None:
    """Only the names a function loads as globals are described: `self.encoder` is not the
    module's `encoder` (here a lock, which would keep the plan out of the cache)."""
    for _ in range(2):
        plan = _plan(_Wrapper(), torch.randn(4, 8), strategy="ddp")
    assert any("read from autoshard's cache" in r for r in plan.reasons), plan.reasons


def _recursive(x: torch.Tensor, depth: int) -> torch.Tensor:
    return x if depth == 0 else _recursive(torch.tanh(x), depth - 1)


class _Recursing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _recursive(self.layer(x), 3).sum()


def test_a_recursive_helper_is_described_once(kept: Path) -> None:
    for _ in range(2):
        plan = _plan(_Recursing(), torch.randn(4, 8), strategy="ddp")
    assert any("read from autoshard's cache" in r for r in plan.reasons), plan.reasons
