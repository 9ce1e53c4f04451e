"""Constructs where a simulated card must behave as a CUDA card: activation checkpointing on
several cards, a card given no samples, models that read tensor values, host tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptune.backends.simulated import estimate_memory

D, T, HID, BLOCKS = 64, 128, 256, 4


class Stack(nn.Module):
    """An input layer, then blocks Linear-GELU-Linear, each optionally checkpointed."""

    def __init__(self, mode: str = "none"):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, HID), nn.GELU(), nn.Linear(HID, D)) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            if self.mode == "none":
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return x


def peaks(mode: str, sizes: list[int]) -> list[int]:
    e = estimate_memory(lambda: Stack(mode), lambda n: torch.randn(n, T, D), sizes,
                        f"{len(sizes)}x24GB", loss_fn=lambda out, batch: out.sum())
    return e.peak_bytes


def u(c: int) -> int:
    """Bytes of one block input/output for a chunk of c samples (fp32)."""
    return c * T * D * 4


def params_bytes() -> int:
    """The model's parameters, each rounded as the allocator rounds it."""
    return sum(-(-p.numel() * 4 // 512) * 512 for p in Stack().parameters())


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
# one 4-card split in `make test` (card 0 idle, uneven chunks); [16, 16, 8, 8] (seconds with a
# reentrant checkpoint) in `make test-slow`
@pytest.mark.parametrize("sizes", [[0, 16], [8, 16], [0, 8, 16, 24],
                                   pytest.param([16, 16, 8, 8], marks=pytest.mark.slow)])
def test_checkpointing_on_several_cards_saves_on_each_card_its_own_chunk(mode, sizes):
    plain, ckpt = peaks("none", sizes), peaks(mode, sizes)
    saved = [p - q for p, q in zip(plain, ckpt)]
    # The hidden activations (h and GELU(h), 4 u each) of all but the block being recomputed
    # are not kept: 3 blocks x 8 u, less checkpoint's own small tensors. With the reentrant
    # form each segment runs its own backward through DataParallel's broadcast, which fills
    # the gradients of the parameters it did not reach with zeros on every card (one
    # transient copy of the parameters' size) and reduces them onto card 0; and it holds the
    # recomputed segment's output (u) while that segment's backward runs.
    reentrant = mode == "reentrant"
    extra = params_bytes() if reentrant else 0
    for card, c in enumerate(sizes):
        if c == 0:
            # card 0 runs no replica: nothing of the other cards' recomputation lands there
            assert 0 <= ckpt[card] - plain[card] <= extra
        elif card > 0:
            low = (23 if reentrant else 24) * u(c) - 32 * 1024
            assert low <= saved[card] <= 24 * u(c), (card, saved[card] / u(c))
        else:   # card 0 also holds the gathered output; its peak comes at another moment
            assert 20 * u(c) - extra <= saved[card] <= 24 * u(c), saved[card] / u(c)
    # the saving on a card depends on its own chunk only
    for a in range(1, len(sizes)):
        for b in range(1, len(sizes)):
            if sizes[a] == sizes[b]:
                assert saved[a] == saved[b]


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointing_under_bf16_autocast_recomputes_in_bf16(mode):
    """The checkpoint restores the forward's CUDA autocast state when it recomputes (on the
    fake cards it would otherwise restore the CPU's: fp32, and a CheckpointError)."""
    def bf16_peaks(m: str) -> list[int]:
        return estimate_memory(lambda: Stack(m), lambda n: torch.randn(n, T, D), [0, 16],
                               "2x24GB", loss_fn=lambda out, batch: out.float().sum(),
                               amp="bf16").peak_bytes

    plain, ckpt = bf16_peaks("none"), bf16_peaks(mode)
    saved = plain[1] - ckpt[1]
    # per block not kept: h and GELU(h), 4 u each in fp32, 2 u each in bf16: 3 blocks x 4 u,
    # less checkpoint's own small tensors (and, reentrant, the recomputed output, below u)
    assert 10.5 * u(16) <= saved <= 12 * u(16), saved / u(16)


def test_hf_gradient_checkpointing_on_two_cards():
    from transformers import GPT2Config, GPT2LMHeadModel

    def model(ckpt: bool):
        # no cache: DataParallel gathers past_key_values onto card 0, and HF drops the cache
        # under checkpointing, which would change card 0 for another reason
        cfg = GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=128, vocab_size=100,
                         use_cache=False)
        m = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        if ckpt:
            m.gradient_checkpointing_enable()   # HF's default: the reentrant form
        return m

    def sample(n: int) -> dict:
        ids = torch.randint(0, 100, (n, 128))
        return {"input_ids": ids, "labels": ids}

    plain = estimate_memory(model(False), sample, [0, 8], "2x24GB").peak_bytes
    ckpt = estimate_memory(model(True), sample, [0, 8], "2x24GB").peak_bytes
    assert ckpt[0] == plain[0]          # nothing of card 1's recomputation lands on card 0
    assert ckpt[1] < plain[1] - 2 * u(8)


def test_a_failure_in_dptunes_own_hook_is_reported_as_dptunes(monkeypatch):
    from dptune.backends import simulated
    from dptune.errors import InternalError, UserCodeError

    real = simulated._Ledger.retag

    def broken(self, t, category):
        if category == "gradients":        # only in the hook on the replicas' weights
            raise KeyError("boom")
        return real(self, t, category)

    monkeypatch.setattr(simulated._Ledger, "retag", broken)
    with pytest.raises(InternalError, match="dptune's simulator failed in the gradient hook") as info:
        estimate_memory(Stack(), lambda n: torch.randn(n, T, D), [2, 2], "2x24GB",
                        loss_fn=lambda out, batch: out.sum())
    assert not isinstance(info.value, UserCodeError)
    assert "bug in dptune, not in your model" in str(info.value)
    causes, e = [], info.value
    while e is not None:
        causes.append(type(e))
        e = e.__cause__
    assert KeyError in causes               # the original failure stays chained


# ---- models that read tensor values -------------------------------------------------------
class Experts(nn.Module):
    """Top-1 routing over two experts; ``dense`` runs every expert on every row instead."""

    def __init__(self, dense: bool = False):
        super().__init__()
        self.dense = dense
        self.router = nn.Linear(D, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, HID), nn.GELU(), nn.Linear(HID, D))
                                     for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if self.dense:
                y = y + expert(x)
            else:
                rows = (choice == i).nonzero().squeeze(-1)
                y = y.index_add(0, rows, expert(x.index_select(0, rows)))
        return y


def test_nonzero_is_bounded_by_its_element_count_and_said_so():
    sample = lambda n: torch.randn(n, D)   # noqa: E731
    routed = estimate_memory(Experts(), sample, [0, 64, 64], "3x24GB", loss_fn=lambda o, b: o.sum())
    dense = estimate_memory(Experts(dense=True), sample, [0, 64, 64], "3x24GB",
                            loss_fn=lambda o, b: o.sum())
    note = next(n for n in routed.notes if "data-dependent" in n)
    assert "aten.nonzero sized as if all of its up to 64 elements were selected" in note
    # each expert is charged as if it got every row: the dense model's activations, plus the
    # routing's own small tensors (masks, indices, selected copies: at most 64 x (D+HID) floats)
    for card in (1, 2):
        extra = routed.peak_bytes[card] - dense.peak_bytes[card]
        assert 0 < extra <= 2 * 64 * (D + HID) * 4, extra
    assert routed.peak_bytes[0] == dense.peak_bytes[0]   # card 0 runs no replica


def test_item_used_as_a_number_and_boolean_masks_run():
    class Normalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            y = self.lin(x)
            kept = y[y > 0]                              # boolean-mask indexing
            return y.sum() / (y > 0).sum().item() + kept.sum()

    e = estimate_memory(Normalised(), lambda n: torch.randn(n, D), [8, 8], "2x24GB",
                        loss_fn=lambda o, b: o.sum())
    note = next(n for n in e.notes if "data-dependent" in n)
    assert ".item()" in note and "aten.index" in note
    assert e.peak_bytes[1] > 0


def test_a_value_used_for_control_flow_still_stops_with_the_users_line():
    from dptune.errors import BackendUnavailableError

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum().item() > 0 else y

    with pytest.raises(BackendUnavailableError, match="reads tensor values at test_sim_constructs.py"):
        estimate_memory(Branches(), lambda n: torch.randn(n, D), [4, 4], "2x24GB",
                        loss_fn=lambda o, b: o.sum())


# ---- smaller gaps ---------------------------------------------------------------------------
class Emb(nn.Module):
    def __init__(self, sparse: bool = False):
        super().__init__()
        self.e = nn.Embedding(1000, 64, sparse=sparse)
        self.lin = nn.Linear(64, 4)

    def forward(self, x):
        return self.lin(self.e(x))


def ids(n: int) -> torch.Tensor:
    return torch.randint(0, 1000, (n, 16))


def test_sparse_embedding_gradients_are_charged_by_their_indices_and_values():
    kw = dict(loss_fn=lambda o, b: o.sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    sparse = estimate_memory(Emb(sparse=True), ids, [4], "1x24GB", **kw)
    dense = estimate_memory(Emb(), ids, [4], "1x24GB", **kw)
    # a dense gradient of the 1000 x 64 table against 64 rows of values and their indices
    assert dense.breakdown[0]["gradients"] - sparse.breakdown[0]["gradients"] >= 1000 * 64 * 4 // 2
    assert sparse.peak_bytes[0] < dense.peak_bytes[0]


def test_factory_converting_dtype_on_meta_and_compiled_models_run():
    e = estimate_memory(lambda: Emb().to(torch.bfloat16), ids, [2, 2], "2x24GB",
                        loss_fn=lambda o, b: o.float().sum())
    # the table in bf16: 2 bytes an entry, not fp32's 4
    assert 1000 * 64 * 2 <= e.breakdown[0]["weights"] < 1000 * 64 * 4
    compiled = estimate_memory(torch.compile(Emb()), ids, [2, 2], "2x24GB", loss_fn=lambda o, b: o.sum())
    eager = estimate_memory(Emb(), ids, [2, 2], "2x24GB", loss_fn=lambda o, b: o.sum())
    assert compiled.peak_bytes == eager.peak_bytes
    assert any("torch.compile: the model runs eagerly" in n for n in compiled.notes)


def test_an_fp16_batch_into_an_fp32_layer_fails_as_on_cuda():
    from dptune.errors import UserCodeError

    with pytest.raises(UserCodeError, match=r"in the forward.*same dtype.*aten\.addmm"):
        estimate_memory(nn.Linear(8, 8), lambda n: torch.randn(n, 8, dtype=torch.float16), [2, 2],
                        "2x24GB", loss_fn=lambda o, b: o.float().sum())
    with pytest.raises(UserCodeError, match=r"Input type .* should be the same"):
        estimate_memory(nn.Conv2d(3, 4, 3), lambda n: torch.randn(n, 3, 8, 8, dtype=torch.bfloat16),
                        [2], "1x24GB", loss_fn=lambda o, b: o.float().sum())
    # the same batch in the layer's dtype runs
    assert estimate_memory(nn.Linear(8, 8), lambda n: torch.randn(n, 8), [2, 2], "2x24GB",
                           loss_fn=lambda o, b: o.sum()).peak_bytes[1] > 0


class MakesTensors(nn.Module):
    """A Linear, then what ``how`` says the forward makes: a vector of D added to the
    activations (``"host add"``: made without ``device=``; ``"card add"``: with
    ``device=x.device``; ``"to add"``: made on the host and moved with ``.to(x.device)``;
    ``"cuda add"``: ``device="cuda"``; ``"scalar"``: a 0-dim host tensor), or a tensor of
    ``KEEP`` bytes made first and returned beside the output (``"host keep"``, ``"card keep"``),
    or host work on ``KEEP`` bytes never used with the card's tensors (``"host only"``)."""

    KEEP = 4 * 2**20

    def __init__(self, how: str = "none"):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor):
        how, n = self.how, self.KEEP // 4
        if how.endswith("keep"):
            kept = torch.ones(n) if how == "host keep" else torch.ones(n, device=x.device)
            return self.lin(x), kept
        h = self.lin(x)
        if how == "host add":
            h = h + torch.ones(D)
        elif how == "card add":
            h = h + torch.ones(D, device=x.device)
        elif how == "to add":
            h = h + torch.ones(D).to(x.device)
        elif how == "cuda add":
            h = h + torch.ones(D, device="cuda")
        elif how == "scalar":
            h = h * torch.tensor(0.5)
        elif how == "host only":
            junk = torch.ones(n) * 2
            del junk
        return h, None


def host_estimate(how: str, sizes: list[int]):
    return estimate_memory(lambda: MakesTensors(how), lambda n: torch.randn(n, T, D), sizes,
                           f"{len(sizes)}x24GB", loss_fn=lambda out, batch: out[0].sum(),
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.parametrize("sizes, card", [([4], 0), ([4, 4], 0), ([0, 4], 1)])
def test_a_host_tensor_added_to_a_card_tensor_fails_as_on_cuda(sizes, card):
    from dptune.errors import EXIT_USER_CODE, UserCodeError

    with pytest.raises(UserCodeError) as info:
        host_estimate("host add", sizes)
    msg = str(info.value)
    # the user's error, naming the op, CUDA's wording and the user's line
    assert info.value.exit_code == EXIT_USER_CODE
    assert f"in the forward of replica {card} on virtual card {card}" in msg
    assert (f"Expected all tensors to be on the same device, but found at least two devices, "
            f"cuda:{card} and cpu!") in msg
    assert "aten.add.Tensor" in msg
    assert "test_sim_constructs.py" in msg and "h = h + torch.ones(D)" in msg


@pytest.mark.parametrize("how", ["card add", "to add", "cuda add", "scalar"])
def test_card_tensors_and_host_scalars_mix_as_on_cuda(how):
    plain = host_estimate("none", [4, 4]).peak_bytes
    peaks = host_estimate(how, [4, 4]).peak_bytes
    assert all(p >= q > 0 for p, q in zip(peaks, plain))


def test_a_tensor_made_on_the_card_is_charged_there_and_a_host_tensor_is_not():
    plain = host_estimate("none", [4]).peak_bytes[0]
    # made first in the forward and alive to the end of the step (the output is kept through
    # optimizer.step()), so it adds its bytes to the card's peak exactly
    assert host_estimate("card keep", [4]).peak_bytes[0] == plain + MakesTensors.KEEP
    # on the host: nothing, to the byte
    assert host_estimate("host keep", [4]).peak_bytes[0] == plain
    # host work that never meets a card tensor costs no card memory, on every card
    assert host_estimate("host only", [4, 4]).peak_bytes == host_estimate("none", [4, 4]).peak_bytes


def test_a_loss_reading_the_batch_gets_it_on_the_output_card():
    """As on CUDA, where dptune moves the batch to card 0 for a ``loss_fn``: the targets
    meet the gathered outputs there (they would be host tensors otherwise)."""
    class Classifier(nn.Linear):
        def forward(self, x, labels):       # the labels ride along, unused
            return super().forward(x)

    def sample(n):
        return torch.randn(n, D), torch.zeros(n, dtype=torch.long)

    def loss(out, batch):
        return nn.functional.cross_entropy(out, batch[1])

    e = estimate_memory(lambda: Classifier(D, D), sample, [2, 2], "2x24GB", loss_fn=loss)
    assert e.peak_bytes[0] > 0


@pytest.mark.parametrize("part, where", [("_target", "placing a new tensor"),
                                         ("check_devices", "the device check")])
def test_a_failure_in_dptunes_device_rules_is_reported_as_dptunes(monkeypatch, part, where):
    from dptune.backends.simulated import device_rules as _devices, dispatch as simulated
    from dptune.errors import InternalError, UserCodeError

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(_devices if part == "_target" else simulated, part, broken)
    with pytest.raises(InternalError, match=f"dptune's simulator failed.*{where}") as info:
        host_estimate("card add", [4, 4])
    assert not isinstance(info.value, UserCodeError)
    causes, e = [], info.value
    while e is not None and len(causes) < 10:   # bounded: a cycle would be a bug too
        causes.append(type(e))
        e = e.__cause__
    assert causes == [InternalError, KeyError]   # the original failure chained, once


class GroupedExperts(nn.Module):
    """Expert layers as transformers 5 runs them: one ``torch._grouped_mm`` over all experts."""

    def __init__(self, dtype: torch.dtype, experts: int = 4, k: int = 16, n: int = 32):
        super().__init__()
        self.experts = experts
        self.weight = nn.Parameter(torch.randn(experts, k, n, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per = x.shape[0] // self.experts
        offs = torch.arange(1, self.experts + 1, device=x.device, dtype=torch.int32) * per
        w = self.weight
        return torch._grouped_mm(x.to(w.dtype), w, offs=offs, out_dtype=w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_mm_runs_in_every_dtype_cuda_takes(dtype):
    """CUDA runs ``_grouped_mm`` in fp32 and fp16 through its fallback kernel (a Mixtral-style
    model with fp32 master weights, also under autocast); torch's meta kernel asks for bf16."""
    seen = []

    def loss(out, batch):
        seen.append((out.dtype, tuple(out.shape)))
        return out.float().sum()

    e = estimate_memory(lambda: GroupedExperts(dtype), lambda n: torch.randn(n, 16), [8, 16],
                        "2x24GB", loss_fn=loss)
    assert seen == [(dtype, (24, 32))]       # each replica's (S, N), gathered
    assert e.peak_bytes[1] > 0


def test_an_error_from_a_fake_kernel_says_the_simulator_may_be_at_fault():
    """An error raised inside torch's fake (meta) kernels may be the simulator's, not the
    model's: the message says how to tell; an error the model raises itself does not."""
    from dptune.errors import UserCodeError

    class Mismatch(nn.Module):
        def __init__(self, own_error: bool):
            super().__init__()
            self.w, self.own_error = nn.Parameter(torch.randn(5, 7)), own_error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.own_error:
                raise ValueError("the model's own check")
            return x @ self.w

    for own, note in ((False, True), (True, False)):
        with pytest.raises(UserCodeError) as e:
            estimate_memory(lambda own=own: Mismatch(own), lambda n: torch.randn(n, 4), [2, 2], "2x24GB")
        assert ("fake kernel meta_mm" in str(e.value)
                and "if this step runs on a GPU, the simulator is wrong" in str(e.value)) == note


def test_an_rnn_on_packed_sequences_says_why_it_cannot_be_simulated():
    """pack_padded_sequence sizes its data from the lengths' values (bounded here by the padded
    input); the LSTM then sizes its state from batch_sizes[0], a value: exit 4 with the way out,
    not a crash of dptune's ledger (it was an InternalError on an unbounded size)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from dptune.errors import BackendUnavailableError

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn = nn.Embedding(50, 8), nn.LSTM(8, 16, batch_first=True)

        def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            packed = pack_padded_sequence(self.emb(ids), lengths.cpu(), batch_first=True,
                                          enforce_sorted=False)
            return self.rnn(packed)[1][0]

    def sample(n: int) -> tuple:
        return torch.randint(0, 50, (n, 12)), torch.randint(1, 13, (n,))

    with pytest.raises(BackendUnavailableError, match="RNN at .*PackedSequence.*padded batches"):
        estimate_memory(lambda: Packed(), sample, [2, 4], "2x24GB",
                        loss_fn=lambda out, batch: out.sum())


def test_a_type_error_naming_a_fake_tensor_outside_an_rnn_is_the_models():
    """Only an RNN's packed batch sizes are taken as a value read; a model passing a tensor
    where torch wants ints fails the same way on a GPU: the user's error (exit 1)."""
    from dptune.errors import UserCodeError

    class BadView(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).view(torch.ones(2, 2, device=x.device))

    with pytest.raises(UserCodeError, match="TypeError"):
        estimate_memory(lambda: BadView(), lambda n: torch.randn(n, 4), [2, 2], "2x24GB")
