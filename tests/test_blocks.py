"""Which submodules are the repeated blocks (`find_blocks`): the FSDP units and the AC units."""

from __future__ import annotations

from torch import nn

from autoshard.decide.blocks import find_blocks


class Layer(nn.Module):
    """A transformer-like layer; with `nested`, it holds another Layer (HF's nested classes)."""

    def __init__(self, width: int = 8, nested: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.inner = Layer(width) if nested else None


class Other(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


def names(model: nn.Module) -> list[str]:
    return [name for name, _ in find_blocks(model)]


def test_no_split_modules_names_the_block_class() -> None:
    class HFModel(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList([Layer() for _ in range(3)])
            self.head = nn.Linear(8, 10)

    model = HFModel()
    blocks = find_blocks(model)
    assert [name for name, _ in blocks] == [
        "decoder.layers.0",
        "decoder.layers.1",
        "decoder.layers.2",
    ]
    # The very module objects, in forward order.
    assert all(module is model.decoder.layers[i] for i, (_, module) in enumerate(blocks))


def test_no_split_modules_nested_matches_keep_only_the_outermost() -> None:
    class HFModel(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(nested=True) for _ in range(2)])
            self.last = Layer(nested=True)  # outside the list, still a block

    model = HFModel()
    # layers.0.inner and last.inner are Layers too, but inside an outer Layer.
    assert names(model) == ["layers.0", "layers.1", "last"]


def test_no_split_modules_with_several_classes() -> None:
    class HFModel(nn.Module):
        _no_split_modules = ["Layer", "Other"]

        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList([Other() for _ in range(2)])
            self.decoder = nn.ModuleList([Layer() for _ in range(2)])

    assert names(HFModel()) == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]


def test_no_split_modules_wins_over_a_larger_uniform_list() -> None:
    class HFModel(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(4) for _ in range(2)])
            self.big = nn.ModuleList([Other(64) for _ in range(5)])  # more parameters

    assert names(HFModel()) == ["layers.0", "layers.1"]


def test_no_split_modules_that_match_nothing_fall_back_to_repeated_children() -> None:
    class HFModel(nn.Module):
        _no_split_modules = ["LlamaDecoderLayer"]

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(3)])

    assert names(HFModel()) == ["layers.0", "layers.1", "layers.2"]


def test_module_list_of_same_class_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([Layer() for _ in range(4)])
            self.head = nn.Linear(8, 2)

    model = Model()
    blocks = find_blocks(model)
    assert [name for name, _ in blocks] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [module for _, module in blocks] == list(model.blocks)


def test_sequential_of_same_class_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 8)
            self.trunk = nn.Sequential(*[Layer() for _ in range(3)])

    assert names(Model()) == ["trunk.0", "trunk.1", "trunk.2"]


def test_a_list_of_lists_has_the_layers_inside_as_blocks() -> None:
    """Funnel-Transformer keeps its layers in stages, a ModuleList of ModuleLists. Before, the
    stages were the blocks: FSDP2 refuses a container without forward, and every sharded
    strategy was "not offered, as its step fails"."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.ModuleList([Layer(), Layer()]) for _ in range(3)])
            self.head = nn.Linear(8, 2)

    assert names(Model()) == [f"stages.{i}.{j}" for i in range(3) for j in range(2)]


def test_a_sequential_of_sequential_stages_keeps_the_stages_as_blocks() -> None:
    """A Sequential has a forward: its stages stay the blocks, as before."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(*[nn.Sequential(Layer(), Layer()) for _ in range(3)])

    assert names(Model()) == ["trunk.0", "trunk.1", "trunk.2"]


def test_of_two_candidate_lists_the_larger_by_parameter_count_wins() -> None:
    # `many` has more children, `wide` more parameters: parameters decide, whatever the order.
    many_numel = 6 * (4 * 4 + 4)
    wide_numel = 2 * (32 * 32 + 32)
    assert wide_numel > many_numel

    class ManyFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.many = nn.ModuleList([Layer(4) for _ in range(6)])
            self.wide = nn.ModuleList([Other(32) for _ in range(2)])

    class WideFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wide = nn.ModuleList([Other(32) for _ in range(2)])
            self.many = nn.ModuleList([Layer(4) for _ in range(6)])

    assert names(ManyFirst()) == ["wide.0", "wide.1"]
    assert names(WideFirst()) == ["wide.0", "wide.1"]


def test_outer_list_wins_over_uniform_containers_inside_its_blocks() -> None:
    # Each block is itself a Sequential of two Linears (uniform), but the outer list is larger.
    model = nn.Module()
    model.blocks = nn.ModuleList(
        [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(3)]
    )
    assert names(model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_alternating_classes_are_all_blocks() -> None:
    # issue 12: a list whose blocks alternate two classes gave 0 blocks (one FSDP unit)
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Other(), Layer(), Other()])

    assert names(Model()) == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_in_a_mixed_list_only_repeated_classes_are_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Other(), Layer(), Layer(), Layer()])  # a stem first

    assert names(Model()) == ["layers.1", "layers.2", "layers.3"]


def test_a_sequential_mlp_of_leaf_layers_is_not_blocks() -> None:
    mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    assert names(mlp) == []


def test_a_mixed_list_without_a_repeated_class_is_skipped() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixed = nn.ModuleList([Other(64), Layer(64)])  # larger, but nothing repeats
            self.layers = nn.ModuleList([Layer(8) for _ in range(2)])

    assert names(Model()) == ["layers.0", "layers.1"]


def test_a_uniform_list_without_parameters_is_not_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.acts = nn.ModuleList([nn.ReLU() for _ in range(4)])

    assert names(Model()) == []


def test_a_single_child_list_is_not_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

    assert names(Model()) == []


def test_model_without_repeated_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(4, 16)
            self.act = nn.GELU()
            self.fc2 = nn.Linear(16, 2)

    assert find_blocks(Model()) == []


class _Res(nn.Module):
    """A residual block of a UNet written by hand: two convolutions."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, out, 3, padding=1)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1)


class _Down(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.res = _Res(channels, channels)  # a repeated class inside a block: not a block
        self.pool = nn.Conv2d(channels, channels, 3, stride=2, padding=1)


class _HandUNet(nn.Module):
    """Blocks held as attributes, no list: as many UNets and GAN generators are written."""

    def __init__(self) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.Linear(4, 4), nn.SiLU())  # small, with the head's class
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.down1 = _Down(16)
        self.down2 = _Down(16)
        self.mid = _Res(16, 16)
        self.up = _Res(32, 16)
        self.head = nn.Sequential(nn.GroupNorm(4, 16), nn.Conv2d(16, 3, 1))


def test_blocks_held_as_attributes_are_the_outermost_of_each_repeated_class() -> None:
    """A held-out sweep's UNet had 0 blocks: nothing could be checkpointed and FSDP2 gathered
    the whole model as one unit. Its repeated classes are its blocks now, the outermost of
    each, in the model's order; a repeated class holding under a tenth of the largest's
    parameters (two small Sequentials) stays in the root unit."""
    assert names(_HandUNet()) == ["down1", "down2", "mid", "up"]


def test_blocks_held_as_attributes_of_one_part() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()  # one of a kind: the repeated class is inside it
            self.encoder.first = Other(16)
            self.encoder.second = Other(16)
            self.head = nn.Linear(16, 2)

    assert names(Model()) == ["encoder.first", "encoder.second"]


def test_a_list_of_blocks_comes_before_blocks_held_as_attributes() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Res(8, 8) for _ in range(2)])
            self.a, self.b = _Down(8), _Down(8)

    assert names(Model()) == ["layers.0", "layers.1"]


# ---------------------------------------------------------------------------------------------
# issue 12: blocks that make good units


def test_no_split_embeddings_are_not_a_block() -> None:
    # BERT and ViT name their embeddings module in _no_split_modules; it occurs once: not a block
    class Embeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(10, 8)

    class HFModel(nn.Module):
        _no_split_modules = ["Embeddings", "Layer"]

        def __init__(self) -> None:
            super().__init__()
            self.embeddings = Embeddings()
            self.layers = nn.ModuleList([Layer() for _ in range(2)])

    assert names(HFModel()) == ["layers.0", "layers.1"]


def test_encoder_and_decoder_of_nn_transformer_are_all_blocks() -> None:
    # issue 12: only the decoder layers were found (the larger list)
    model = nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32
    )
    assert names(model) == [
        "encoder.layers.0",
        "encoder.layers.1",
        "decoder.layers.0",
        "decoder.layers.1",
        "decoder.layers.2",
    ]


class Stage(nn.Module):
    """A ConvNeXt-like stage: a downsampling layer, then `depth` blocks of `width` channels."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Linear(width, width)
        self.blocks = nn.ModuleList([Layer(width) for _ in range(depth)])


def test_a_stage_holding_most_parameters_is_split_into_its_blocks() -> None:
    # issue 12: ConvNeXt's 4 stages were the blocks, the last holding 74% of the parameters
    model = nn.Module()
    model.stages = nn.ModuleList([Stage(4, 2), Stage(8, 2), Stage(16, 2), Stage(48, 2)])
    sizes = [sum(p.numel() for p in s.parameters()) for s in model.stages]
    assert sizes[-1] > sum(sizes) / 2  # the last stage holds most of them
    assert names(model) == [f"stages.{s}.blocks.{b}" for s in range(4) for b in range(2)]


def test_balanced_stages_stay_whole() -> None:
    model = nn.Module()
    model.stages = nn.ModuleList([Stage(8, 2) for _ in range(3)])
    assert names(model) == ["stages.0", "stages.1", "stages.2"]


def test_a_block_tied_to_the_root_stays_in_the_root() -> None:
    # issue 12: BERT's tied decoder weight left the embeddings block shared with the root unit,
    # which FSDP2 refuses ("... already managed by another FSDP group")
    from autoshard.decide.blocks import blocks_and_notes

    model = nn.Module()
    model.layers = nn.ModuleList([Layer() for _ in range(3)])
    model.head = nn.Linear(8, 8)
    model.head.weight = model.layers[0].proj.weight
    blocks, notes = blocks_and_notes(model)
    assert [n for n, _ in blocks] == ["layers.1", "layers.2"]
    assert notes == [
        "layers.0 is not a block: its parameter 'layers.0.proj.weight' is shared with "
        "'head.weight', so it stays in the root FSDP unit (FSDP2 needs tied parameters in one "
        "unit)"
    ]


def test_blocks_sharing_a_parameter_both_stay_in_the_root() -> None:
    from autoshard.decide.blocks import blocks_and_notes

    model = nn.Module()
    model.layers = nn.ModuleList([Layer() for _ in range(4)])
    model.layers[3].proj.weight = model.layers[1].proj.weight
    blocks, notes = blocks_and_notes(model)
    assert [n for n, _ in blocks] == ["layers.0", "layers.2"]
    assert [n.split(" ")[0] for n in notes] == ["layers.1", "layers.3"]
