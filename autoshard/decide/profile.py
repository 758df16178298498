"""What the trace of the example batch found (`measure.trace`), as the estimate reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _Counted:
    """A call counted where it ran: in each block, and outside them."""

    block_calls: tuple[int, ...]
    other_calls: int

    @property
    def calls(self) -> int:
        return sum(self.block_calls) + self.other_calls


@dataclass(frozen=True)
class PricedCall(_Counted):
    """One FLOP-bound operator of the forward (a matmul, a convolution, attention) at one set of
    arguments, and how often it ran: what `measure.rates` runs again on the device to time the
    model's own FLOPs at their own shapes.

    Attributes:
        operator: the operator overload's name ("aten.mm.default").
        arguments: its positional and keyword arguments as JSON, each tensor as
            {"tensor": [shape, stride, dtype, requires_grad]}; "" where one could not be
            written so (the call is then not run again).
        flops: forward FLOPs of one call.
        block_calls: its calls in each block, in block order.
        other_calls: its calls outside the blocks (embeddings, head, loss).
    """

    operator: str
    arguments: str
    flops: int
    block_calls: tuple[int, ...]
    other_calls: int

    @property
    def total_flops(self) -> int:
        return self.flops * self.calls


@dataclass(frozen=True)
class MovingCall(_Counted):
    """One memory-bound operator of the step (elementwise, a normalisation, a reduction, a cast,
    a copy) at one set of arguments, as autograd dispatched it in forward or in backward, and how
    often it ran: what `measure.rates` runs again on the device to time the model's own traffic
    at its own shapes (a backward is its own calls: each runs again alone, without gradients).

    Attributes:
        operator: the operator overload's name ("aten.add.Tensor").
        arguments: as `PricedCall.arguments`, every tensor needing no gradient; "" where they
            could not be written.
        moved: bytes one call reads and writes, as `ActivationProfile.forward_traffic` counts
            them.
        block_calls: its calls in each block's forward and backward, in block order.
        other_calls: its calls outside the blocks (embeddings, head, loss; their backward).
    """

    operator: str
    arguments: str
    moved: int
    block_calls: tuple[int, ...]
    other_calls: int

    @property
    def total_bytes(self) -> int:
        return self.moved * self.calls


@dataclass(frozen=True)
class ActivationProfile:
    """What one step of the example batch saves and computes (per rank, unsharded model).

    Attributes:
        block_saved_bytes: bytes saved for backward inside each block (in block order), not
            counting parameters, buffers and the batch, which are not new memory (autocast's
            low-precision weight copies are, and count).
        block_input_bytes: bytes of each block's input, which a checkpointed block still keeps.
        block_cast_bytes: of `block_saved_bytes`, autocast's copies of the parameters in its
            dtype, which autocast keeps in its cache to the end of the forward, saved or not:
            checkpointing a block leaves them alive until the model returns, and frees them only
            from there on (zeros where the trace ran without autocast; empty in a profile made
            without the figure).
        block_shared_bytes: of `block_saved_bytes`, storages a later block or the head saved
            too (the block's output, where its last operator saves it and so does the next
            block's first), not the block's own inputs: checkpointing the block alone does not
            free them (none of them in `block_cast_bytes`; not in the next block's inputs).
        before_saved_bytes: bytes saved before the first block (embeddings).
        after_saved_bytes: bytes saved after the last block (head, loss).
        largest_saved_bytes: the largest single saved storage; its gradient is the largest
            temporary of backward.
        backward_rise_bytes: how far the bytes the step's tensors hold rose in backward above
            where they stood as it began (the saved activations, the output), the parameters'
            gradients left out: the activations' gradients and the formulas' temporaries (a
            scan's per-step gradients, say) less the saved activations freed meanwhile. A
            figure of the whole step, not of blocks: from a shallow trace, the copy's, not
            extended (fewer blocks free as many saved activations before backward's peak, or
            fewer).
        rise_into_buffers_bytes: the same where each parameter's gradient is summed into a
            buffer that holds it already (DDP's buckets, a micro-batch after the first): each
            gradient made, then freed once summed, counted from its making to its summing.
        output_bytes: bytes the model's output holds beyond what backward saves, the
            parameters and the batch (the logits beside a loss computed from them): alive
            through backward and the optimizer step where the loop holds the output, as
            `outputs = model(**batch); outputs.loss.backward()` does.
        block_output_bytes: of `output_bytes`, those each block's forward made (a cache's keys
            and values where backward saves others): a deeper model's output holds more.
        carried_bytes: bytes the model's output holds after backward, but the parameters' and
            the batch's (the logits, a cache's keys and values): a loop that keeps the output
            until the next one replaces it (`outputs = model(**batch)`, the next step's)
            carries them through the next forward.
        block_carried_bytes: of `carried_bytes`, those each block's forward made.
        block_output_left_bytes, block_carried_left_bytes: of `block_output_bytes` and
            `block_carried_bytes`, those a transformers cache alone holds, where the block is a
            transformers layer: checkpointed, it leaves the cache out and adds none of them
            (`engines.checkpoint_block`).
        block_forward_peak_bytes: for each block, the most its forward holds of what it made
            (its saved activations, temporaries and output): checkpointed, what it adds in its
            first forward to the inputs of the blocks before it.
        forward_rise_bytes: how far above what it holds at its end the forward's storages stood
            at their most (a block's temporaries beside the activations saved before it): the
            forward's peak, where the previous output carried into it makes that the step's.
            Of the whole step, as `backward_rise_bytes`.
        block_checkpointed_bytes: for each block, the most it holds when checkpointed, beyond
            what is saved before the blocks and the inputs of the blocks before it: while its
            forward runs again, its input, the gradient reaching it (what backward made and
            holds then) and what its forward makes (saved, temporaries, output); then in its
            backward, its saved activations and what the backward holds beside them (the
            gradients of its activations, the formulas' temporaries, less its saved
            activations freed meanwhile: `rise.BackwardRise`). Empty in a profile made without
            it.
        block_checkpointed_into_buffers_bytes: the same where each parameter's gradient is
            summed into a buffer, counted from its making to its summing.
        block_forward_flops: forward FLOPs of each block.
        total_forward_flops: forward FLOPs of the whole model and loss.
        compute_dtype: the dtype the trace ran in (autocast when mixed precision is on).
        unused_parameters: trainable parameters that got no gradient in the traced step (DDP
            must then look for them every step: find_unused_parameters).
        answers: for a step measured on real tensors, the yes/no values it read back from its
            tensors, by the place in the code that read them (`measure.answers`): the
            simulation answers them alike.
        nonzero_found: for a step measured on real tensors, what `nonzero` found at each place
            in the code it ran (`torch.where(mask)`): (place, elements found, elements
            searched), over the steps measured; the simulation's `nonzero` finds that share
            of its input there (`measure.answers.finding`).
        random_reads: where the step read back a uniform draw, or its comparison with a bound
            inside (0, 1), and what: "torch.rand() < 0.1" (`measure.answers.Draws`). It then
            branches at random, as layers skipped at random (LayerDrop) do.
        batch_values_read: where the fake step branched on a value of the example batch that it
            knew (`measure.known`: a tensor of one value), and what: transformers' mask code
            reading an attention mask of all ones, a read-back. A batch whose values differ (a
            padded mask) takes the other branch, which may hold more.
        flops_by_own_formula: operators whose forward FLOPs autoshard's own formula counted
            because torch's raised on them (grouped-query attention on torch 2.11).
        flops_uncounted: operators whose forward FLOPs no formula could count: counted as 0,
            so the modelled step time leaves them out.
        unlike_blocks: where two blocks alike in all they hold ran different operators in the
            whole model's forward (`measure.operators`), which and how: the model is then
            traced and simulated whole, not extended from a few of its blocks.
        block_forward_traffic: bytes each block's forward reads and writes in operators without
            a FLOP formula (elementwise, normalisations, casts, copies: bound by the device's
            memory bandwidth, not its FLOP/s), views left out.
        block_forward_kernels: operators each block's forward runs, views left out: each is a
            kernel launch, whose host-side cost bounds a step of small operators.
        block_backward_traffic, block_backward_kernels: the same in each block's backward.
        forward_traffic, forward_kernels: the same of the whole forward and loss.
        backward_traffic, backward_kernels: the same of the whole backward.
        priced_calls: the forward's FLOP-bound operators, one per distinct call (`PricedCall`);
            empty where the step was measured on real tensors at a few rows.
        moving_calls: the step's memory-bound operators moving the most bytes in all, one per
            distinct call (`MovingCall`), the most first; empty as `priced_calls` is.
    """

    block_saved_bytes: tuple[int, ...]
    block_input_bytes: tuple[int, ...]
    before_saved_bytes: int
    after_saved_bytes: int
    largest_saved_bytes: int
    block_forward_flops: tuple[int, ...]
    total_forward_flops: int
    compute_dtype: torch.dtype
    unused_parameters: tuple[str, ...] = ()
    answers: tuple[tuple[str, bool], ...] = ()
    nonzero_found: tuple[tuple[str, int, int], ...] = ()
    random_reads: tuple[tuple[str, str], ...] = ()
    batch_values_read: tuple[tuple[str, str], ...] = ()
    flops_by_own_formula: tuple[str, ...] = ()
    flops_uncounted: tuple[str, ...] = ()
    unlike_blocks: str | None = None
    block_forward_traffic: tuple[int, ...] = ()
    block_forward_kernels: tuple[int, ...] = ()
    block_backward_traffic: tuple[int, ...] = ()
    block_backward_kernels: tuple[int, ...] = ()
    forward_traffic: int = 0
    forward_kernels: int = 0
    backward_traffic: int = 0
    backward_kernels: int = 0
    priced_calls: tuple[PricedCall, ...] = ()
    moving_calls: tuple[MovingCall, ...] = ()
    backward_rise_bytes: int = 0
    rise_into_buffers_bytes: int = 0
    output_bytes: int = 0
    block_output_bytes: tuple[int, ...] = ()
    carried_bytes: int = 0
    block_carried_bytes: tuple[int, ...] = ()
    block_output_left_bytes: tuple[int, ...] = ()
    block_carried_left_bytes: tuple[int, ...] = ()
    forward_rise_bytes: int = 0
    block_cast_bytes: tuple[int, ...] = ()
    block_shared_bytes: tuple[int, ...] = ()
    block_forward_peak_bytes: tuple[int, ...] = ()
    block_checkpointed_bytes: tuple[int, ...] = ()
    block_checkpointed_into_buffers_bytes: tuple[int, ...] = ()

    @property
    def other_saved_bytes(self) -> int:
        """Saved outside the blocks: before them (embeddings) and after them (head, loss)."""
        return self.before_saved_bytes + self.after_saved_bytes

    def activation_bytes(self, checkpointed: int) -> int:
        """Peak activation bytes with the first `checkpointed` blocks checkpointed.

        A checkpointed block keeps only its input in forward (Chen et al. 2016, "Training Deep
        Nets with Sublinear Memory Cost", section 3). Backward visits blocks in reverse, so when
        checkpointed block j is recomputed, the head and the blocks after j have already freed
        theirs: then alive are the tensors saved before the blocks, the inputs of blocks 0..j-1
        and block j's recomputed saved tensors. The peak is the larger of that and the end of
        forward as backward begins (`kept_bytes`: autocast's copies of the checkpointed blocks'
        parameters gone by then; alive until the model returns).
        """
        k = min(max(checkpointed, 0), len(self.block_saved_bytes))
        if k == 0:
            return self.kept_bytes(0)
        recompute = max(
            self.before_saved_bytes + sum(self.block_input_bytes[:j]) + self.block_saved_bytes[j]
            for j in range(k)
        )
        return max(self.kept_bytes(k), recompute)

    def kept_bytes(self, checkpointed: int, casts_cached: bool = False) -> int:
        """Bytes saved at the end of forward with the first `checkpointed` blocks checkpointed:
        those blocks keep only their inputs and what the blocks after them save too
        (`block_shared_bytes`), and with `casts_cached` (autocast computes, and the model has
        not returned) their parameters' copies too (`block_cast_bytes`)."""
        k = min(max(checkpointed, 0), len(self.block_saved_bytes))
        shared = self.block_shared_bytes or (0,) * len(self.block_saved_bytes)
        dropped = sum(
            self.block_saved_bytes[i] - self.block_input_bytes[i] - shared[i] for i in range(k)
        )
        return (
            self.other_saved_bytes
            + sum(self.block_saved_bytes)
            - dropped
            + (self.cached_casts(k) if casts_cached else 0)
        )

    def cached_casts(self, checkpointed: int) -> int:
        """Of the first `checkpointed` blocks, the parameters' copies autocast keeps in its cache
        (`block_cast_bytes`): alive through the forward, the blocks checkpointed or not."""
        return sum(self.block_cast_bytes[: max(checkpointed, 0)])

    def checkpointed_moments(
        self, checkpointed: int, into_buffers: bool
    ) -> list[tuple[int, int]] | None:
        """Each checkpointed block's recomputation and backward, the first `checkpointed`
        blocks checkpointed, in block order, as (saved activations alive, the rest: the
        gradients, temporaries); None where no block is checkpointed or the profile has no
        block's figures. When checkpointed block j runs again, alive are the tensors saved
        before the blocks, the inputs of blocks 0..j-1 and what block j holds
        (`block_checkpointed_bytes`, or with `into_buffers` the same with each parameter's
        gradient until summed into its buffer), its own saved activations first."""
        held = (
            self.block_checkpointed_into_buffers_bytes
            if into_buffers
            else self.block_checkpointed_bytes
        )
        k = min(max(checkpointed, 0), len(self.block_saved_bytes))
        if k == 0 or len(held) != len(self.block_saved_bytes):
            return None
        moments = []
        for j in range(k):
            alive = self.before_saved_bytes + sum(self.block_input_bytes[:j])
            saved = min(self.block_saved_bytes[j], held[j])
            moments.append((alive + saved, held[j] - saved))
        return moments

    def output_held(self, checkpointed: int) -> int:
        """`output_bytes` with the first `checkpointed` blocks checkpointed: without what those
        leave out of it (`block_output_left_bytes`)."""
        return self.output_bytes - sum(self.block_output_left_bytes[: max(checkpointed, 0)])

    def carried(self, checkpointed: int) -> int:
        """`carried_bytes` with the first `checkpointed` blocks checkpointed: without what those
        leave out of the output (`block_carried_left_bytes`)."""
        return self.carried_bytes - sum(self.block_carried_left_bytes[: max(checkpointed, 0)])

    def checkpointed_forwards(self, checkpointed: int, casts_cached: bool = False) -> list[int]:
        """The activations alive at the most of each checkpointed block's first forward, the
        first `checkpointed` blocks checkpointed: the tensors saved before the blocks, the
        inputs of blocks 0..j, what block j's forward made (`block_forward_peak_bytes`), what
        the output holds of the blocks before it (`output_held`, but what blocks j on add
        to it), and with `casts_cached` (autocast computes) the parameters' copies of the
        blocks before it (`cached_casts`); none where the profile has no block's figures."""
        n = len(self.block_saved_bytes)
        k = min(max(checkpointed, 0), n)
        if len(self.block_forward_peak_bytes) != n or len(self.block_output_bytes) != n:
            return []
        return [
            self.before_saved_bytes
            + sum(self.block_input_bytes[: j + 1])
            + self.block_forward_peak_bytes[j]
            + self.output_held(j)
            - sum(self.block_output_bytes[j:])
            + (self.cached_casts(j) if casts_cached else 0)
            for j in range(k)
        ]

    def recompute_flops(self, checkpointed: int) -> int:
        return sum(self.block_forward_flops[: max(checkpointed, 0)])

    def recompute_traffic(self, checkpointed: int) -> int:
        return sum(self.block_forward_traffic[: max(checkpointed, 0)])

    def recompute_kernels(self, checkpointed: int) -> int:
        return sum(self.block_forward_kernels[: max(checkpointed, 0)])
