"""Models and synthetic data for the distributed training benchmark (``bench/train.py``).

Three models with the gradient structure of the models in the OmniReduce paper, small enough to train
on a CPU yet with large embedding tables whose gradients are row-sparse. Each model is built in two
variants that differ only in the ``sparse=`` flag of their ``nn.Embedding`` tables: with ``sparse=True``
the embedding gradients are sparse COO tensors (what gloo's sparse allreduce sums), with ``sparse=False``
they are dense tensors that are zero outside the rows a batch touched (what dense allreduce and
OmniReduce's block sparsity see). Both variants use the same initial parameters for the same ``seed``
and an optimizer whose sparse and dense paths do the same math, so trained on the same data they stay
equal up to float rounding.

Every dataset is synthetic and labelled by a hidden, seeded "teacher", so the loss really falls. The
teacher is drawn from ``torch.Generator`` seeded by a hash of (spec seed, a per-model tag); batch
``step`` of ``rank`` from a generator seeded by a hash of (spec seed, rank, step): batches are
deterministic, differ between ranks and steps, and do not depend on the world size (rank r sees the same
stream in any world). Ids are drawn from Zipf distributions (P(rank k) proportional to k ** -s, sampled
by ``torch.searchsorted`` over a precomputed float64 CDF; one CDF per spec, cached) and, except for the
language model whose vocabulary is sorted by frequency like a real one, mapped to table rows by a seeded
random permutation: as with hashed features, the popular rows are scattered over the table instead of
packed at its start, which matters to block-sparse aggregation.

Models (sizes at ``scale=1.0``, float32; ``scale`` multiplies every embedding row count):

``ctr``  DeepLight's shape (a DeepFM-like click-through model on Criteo). 26 categorical fields, each
    with its own ``nn.Embedding`` (dim 16) sized by Criteo Kaggle's per-field cardinalities, capped at
    300,000 rows as the hashing trick does (DLRM's ``--max-ind-range``): 2,069,296 rows, 33,108,736
    parameters = 132,434,944 bytes. 13 dense features. Logit = FM pairwise term
    ``0.5 * sum((sum_f e_f) ** 2 - sum_f e_f ** 2)`` + SiLU MLP(26 * 16 + 13 -> 256 -> 128 -> 1):
    143,105 parameters = 572,420 bytes. Data: ids of field f ~ Zipf(s=1.15) over its vocabulary; dense
    features ~ N(0, 1); label ~ Bernoulli(sigmoid(sum_f w_f[id_f] + x . u)) with hidden per-id weights
    w ~ N(0, 0.4^2) and dense weights u ~ N(0, 0.4^2) (about 40% positives: the few popular ids'
    fixed weights shift the mean logit). BCE-with-logits loss; metric accuracy. Default batch 512
    samples. Adagrad, lr 0.02.
``ncf``  NCF's shape (NeuMF: a GMF tower and an MLP tower, each with its own user and item tables).
    250,000 users and 50,000 items, GMF dim 32 and MLP dim 64: four tables, 28,800,000 parameters =
    115,200,000 bytes. SiLU MLP 128 -> 128 -> 64 -> 32, output Linear(32 + 32 -> 1): 26,913
    parameters = 107,652 bytes. Data: users ~ Zipf(s=1.05), items ~ Zipf(s=1.15); label = 1 where
    ``1.5 * p_u . q_i / sqrt(16) + b_u + b_i + N(0, 0.5^2) > 0`` with hidden factors p, q ~ N(0, I_16)
    and biases b ~ N(0, 0.5^2) (50-55% positives). BCE-with-logits loss; metric accuracy. Default
    batch 1024 samples. Adagrad, lr 0.05.
``lm``   An LSTM language model with a large vocabulary (the paper's LSTM on the One Billion Word
    benchmark): vocabulary 100,000, input embedding dim 128, one LSTM layer of hidden size 256, a linear
    projection to 128 (as the big 1B-word models project their LSTM output), and a sampled softmax whose
    output table is an ``nn.Embedding`` of vocab x (128 + 1) (the last column is the output bias), looked
    up only for the batch's targets and 1,024 shared sampled negatives, so both tables get row-sparse
    gradients. Tables: 25,700,000 parameters = 102,800,000 bytes; LSTM and projection: 428,160
    parameters = 1,712,640 bytes. Data: token streams from a seeded Markov chain: unigram
    q = Zipf(s=1.0) over token ids (id = frequency rank); each token has 32 candidate successors drawn from
    q; the next token is its candidate of rank r ~ Zipf(s=1.2) over the 32, or with probability 0.1 a fresh
    draw from q. A batch is ``batch_size`` fresh sequences of 21 tokens: inputs the first 20, targets the
    last 20. Negatives: 1,024 draws from q (with replacement). Loss: cross-entropy over [target, negatives]
    with the log-Q correction (``logit - log(1024 * q(token))``) and accidental hits (negatives equal to the
    target) masked; metric perplexity = exp(loss), lower is better. Default batch 32 sequences x 20 tokens.
    Adagrad, lr 0.02.

Optimizer: ``torch.optim.Adagrad`` for all three (no weight decay, no lr decay,
``initial_accumulator_value=1e-6``). Its sparse and dense paths do the same per-row math (an untouched
row has a zero gradient: its sum and value stay), and its per-coordinate step size lets rarely-seen
embedding rows learn within a few hundred steps, where plain SGD at a stable learning rate barely moves
them (NCF's loss did not move in 200 steps at the SGD rates tried, 0.1 to 10). The small initial accumulator and
the smooth SiLU activations of the MLPs keep the two variants together: trained in lockstep at
``scale=0.01`` their parameters differed by at most ~2e-7 (ctr), ~3e-6 (ncf) and ~1e-5 (lm) after 300
steps, where Adagrad's default accumulator of 0 and ReLU let single coordinates jump apart by up to
``2 * lr`` within 100 steps (see ``ModelSpec.optimizer``).

Embeddings start small, so the FM term and the GMF product start near 0: N(0, 0.01^2) for ctr (as
DeepFM's reference), N(0, 0.05^2) for ncf (NCF's reference uses 0.01, which left the loss flat for the
first ~40 steps at scale 1.0), N(0, 0.1^2) for lm's input table and N(0, 0.05^2) for its output table.

Example::

    spec = get("ctr", scale=0.01)
    model = spec.build(sparse=True)
    opt = spec.optimizer(model.parameters())
    for step in range(100):
        batch = spec.batch(rank=0, world_size=1, step=step, batch_size=spec.default_batch)
        loss, metric = spec.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "ModelSpec",
    "CtrSpec",
    "NcfSpec",
    "LmSpec",
    "MODELS",
    "get",
    "ctr",
    "ncf",
    "lm",
    "is_embedding",
    "CRITEO_VOCAB",
]

#: Cardinalities of Criteo Kaggle's (Display Advertising Challenge) 26 categorical fields, as DLRM counts them.
CRITEO_VOCAB = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)

_MASK64 = (1 << 64) - 1
# Stream tags, so the teacher's and the batches' generators never share a seed.
_TEACHER = 0x7EAC
_BATCH = 0xBA7C


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _seed(*parts: int) -> int:
    """A 63-bit seed mixing ``parts``: nearby inputs (rank 0/1, step 0/1) give unrelated streams."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


def _check_scale(scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def _scaled(rows: int, scale: float, minimum: int) -> int:
    return max(minimum, round(rows * scale))


def _zipf_cdf(n: int, s: float) -> torch.Tensor:
    """CDF over ranks 1..n of P(k) proportional to k ** -s, in float64 (float32 loses the tail of 1M rows)."""
    p = torch.arange(1, n + 1, dtype=torch.float64).pow_(-s)
    cdf = p.cumsum_(0)
    cdf /= cdf[-1].item()
    cdf[-1] = 1.0
    return cdf


class _Zipf:
    """Zipf samplers of several vocabularies (segments) at once: one ``searchsorted`` per batch.

    Segment ``i``'s CDF is stored shifted by ``i`` (its values in (i, i + 1]), so a uniform ``u`` of
    column ``i`` looks up ``i + u`` in the concatenation. Samples are global positions
    (``offsets[i] + rank``), which index the teacher's per-id tables; ``ids`` maps them to table rows.

    Args:
        sizes: rows of each segment.
        exponents: Zipf exponent of each segment.
        permute: map ranks to rows by a random permutation per segment (else row = rank).
        generator: source of the permutations.
    """

    def __init__(self, sizes: Sequence[int], exponents: Sequence[float], permute: bool,
                 generator: torch.Generator) -> None:
        self.sizes = list(sizes)
        self.offsets = torch.tensor([0, *self.sizes]).cumsum(0)
        self.cdf = torch.cat([_zipf_cdf(n, s).add_(i) for i, (n, s) in enumerate(zip(sizes, exponents, strict=True))])
        self._shift = torch.arange(len(self.sizes), dtype=torch.float64)
        self._last = self.offsets[1:] - 1
        if permute:
            self.perm = torch.cat([torch.randperm(n, generator=generator) for n in self.sizes])
        else:
            self.perm = torch.cat([torch.arange(n) for n in self.sizes])

    def positions(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` draws per segment: an (n, segments) int64 tensor of global positions."""
        u = torch.rand(n, len(self.sizes), dtype=torch.float64, generator=generator).add_(self._shift)
        pos = torch.searchsorted(self.cdf, u, right=True)
        # i + u can round up to i + 1 for u just below 1: keep the draw inside its own segment.
        return torch.minimum(pos, self._last)

    def ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Table rows of global positions."""
        return self.perm[positions]


def _embedding(rows: int, dim: int, sparse: bool, std: float) -> nn.Embedding:
    # _weight skips nn.Embedding's own N(0, 1) fill: one pass over a 100 MB table instead of two.
    emb = nn.Embedding(rows, dim, sparse=sparse, _weight=torch.empty(rows, dim))
    nn.init.normal_(emb.weight, std=std)
    return emb


def is_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is an embedding table (its parameters are what ``embedding_bytes`` counts)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def _mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            # Smooth, not ReLU: a unit at a ReLU kink can switch on in one variant and stay off in the
            # other after a rounding difference, and Adagrad then moves its still-untrained weights a
            # whole step in one variant only.
            layers.append(nn.SiLU())
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it, its data, loss, metric and optimizer.

    Args:
        name: "ctr", "ncf" or "lm".
        description: one line: the paper model it mirrors and its size.
        metric: name of the quality metric ``loss`` returns.
        higher_is_better: of the metric.
        lr: the optimizer's learning rate.
        default_batch: the benchmark's batch size (samples; sequences for ``lm``).
        scale: factor on every embedding row count.
        seed: seed of the teacher and of the batches.
        initial_accumulator: Adagrad's ``initial_accumulator_value``.
        init_std: standard deviation of the embedding tables' initial N(0, std^2) values.
    """

    name: str
    description: str
    metric: str
    higher_is_better: bool
    lr: float
    default_batch: int
    scale: float = 1.0
    seed: int = 0
    initial_accumulator: float = 1e-6
    init_std: float = 0.01

    def __getstate__(self) -> dict[str, object]:
        # Pickled to a worker process without the cached teacher (tens of MB): it is rebuilt there.
        state = dict(self.__dict__)
        state.pop("_world", None)
        return state

    def build(self, sparse: bool, seed: int = 0) -> nn.Module:
        """The model, with ``sparse=`` embedding tables; the same ``seed`` gives the same parameters.

        Args:
            sparse: whether the embedding tables produce sparse gradients.
            seed: seed of the initial parameters (the global RNG is left as it was).
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._construct(sparse)

    def batch(self, rank: int, world_size: int, step: int, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Batch ``step`` of ``rank``: deterministic from (spec seed, rank, step).

        Args:
            rank: the rank, in [0, world_size).
            world_size: number of ranks (checked; the data does not depend on it).
            step: training step, >= 0.
            batch_size: samples (sequences for ``lm``), > 0.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and batch_size > 0, got step={step}, batch_size={batch_size}")
        return self._batch(_generator(self.seed, _BATCH, rank, step), batch_size)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        """(scalar loss to backward, metric of this batch).

        Args:
            model: what ``build`` returned, possibly wrapped (DistributedDataParallel): only called.
            batch: what ``batch`` returned.
        """
        raise NotImplementedError

    def optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """Adagrad at ``lr``: the same math for sparse and dense gradients.

        The step is ``lr * g / sqrt(initial_accumulator + sum of g^2)``. With the accumulator starting
        at 0, a coordinate's first step is ``lr * sign(g)`` however small ``g``: a gradient that is a
        near-cancelling sum, and rounds differently in the sparse and the dense variant, would move the
        two apart by up to ``2 * lr``. Starting it at ``initial_accumulator`` bounds that amplification
        by ``lr / sqrt(initial_accumulator)``, and still normalises every gradient above ~1e-3.

        Args:
            params: the model's parameters.
        """
        return torch.optim.Adagrad(params, lr=self.lr, initial_accumulator_value=self.initial_accumulator)

    def embedding_bytes(self) -> int:
        """Bytes of all embedding tables (float32)."""
        return self._bytes()[0]

    def dense_bytes(self) -> int:
        """Bytes of all other parameters (float32)."""
        return self._bytes()[1]

    def _bytes(self) -> tuple[int, int]:
        # Shapes without memory: the model built on the meta device.
        with torch.device("meta"):
            model = self._construct(sparse=False)
        emb = {id(p) for m in model.modules() if is_embedding(m) for p in m.parameters(recurse=False)}
        sizes = [0, 0]
        for p in model.parameters():
            sizes[id(p) not in emb] += p.numel() * 4
        return sizes[0], sizes[1]

    def _construct(self, sparse: bool) -> nn.Module:
        raise NotImplementedError

    def _batch(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


def _binary(model: nn.Module, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(*inputs)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    accuracy = ((logits.detach() > 0) == (labels > 0.5)).float().mean().item()
    return loss, accuracy


# ---------------------------------------------------------------------------------------------- ctr


class CtrModel(nn.Module):
    """DeepFM-like: per-field embeddings, an FM pairwise term and an MLP over embeddings + dense features.

    Args:
        vocab: rows of each field's table.
        dim: embedding dimension.
        dense: number of dense features.
        hidden: MLP hidden sizes.
        sparse: sparse embedding gradients.
        std: standard deviation of the tables' initial values.
    """

    def __init__(self, vocab: Sequence[int], dim: int, dense: int, hidden: Sequence[int], sparse: bool,
                 std: float) -> None:
        super().__init__()
        # Small init: N(0, 1) rows would make the 325-pair FM term dominate the first logits.
        self.embeddings = nn.ModuleList(_embedding(n, dim, sparse, std=std) for n in vocab)
        self.mlp = _mlp([len(vocab) * dim + dense, *hidden, 1], last_activation=False)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = torch.stack([emb(ids[:, f]) for f, emb in enumerate(self.embeddings)], dim=1)  # (B, fields, dim)
        fm = 0.5 * (e.sum(1).square() - e.square().sum(1)).sum(1)
        return self.mlp(torch.cat([e.flatten(1), dense], dim=1)).squeeze(1) + fm


@dataclass(frozen=True)
class CtrSpec(ModelSpec):
    """The ``ctr`` model (DeepLight on Criteo); see the module docstring for the data."""

    vocab: tuple[int, ...] = ()
    dim: int = 16
    dense: int = 13
    hidden: tuple[int, ...] = (256, 128)
    zipf: float = 1.15
    teacher_std: float = 0.4

    @cached_property
    def _world(self) -> tuple[_Zipf, torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, _TEACHER, 1)
        sampler = _Zipf(self.vocab, [self.zipf] * len(self.vocab), permute=True, generator=g)
        weights = torch.randn(int(sampler.offsets[-1]), generator=g) * self.teacher_std
        dense_weights = torch.randn(self.dense, generator=g) * self.teacher_std
        return sampler, weights, dense_weights

    def _construct(self, sparse: bool) -> nn.Module:
        return CtrModel(self.vocab, self.dim, self.dense, self.hidden, sparse, self.init_std)

    def _batch(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        sampler, weights, dense_weights = self._world
        pos = sampler.positions(batch_size, generator)
        x = torch.randn(batch_size, self.dense, generator=generator)
        logit = weights[pos].sum(1) + x @ dense_weights
        labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
        return sampler.ids(pos), x, labels

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        ids, x, labels = batch
        return _binary(model, (ids, x), labels)


def ctr(scale: float = 1.0, seed: int = 0, cap: int = 300_000, dim: int = 16) -> CtrSpec:
    """The ``ctr`` spec.

    Args:
        scale: factor on every field's row count (after the cap).
        seed: data seed.
        cap: the hashing trick's bound on a field's rows.
        dim: embedding dimension.
    """
    _check_scale(scale)
    vocab = tuple(_scaled(min(n, cap), scale, 2) for n in CRITEO_VOCAB)
    rows = sum(vocab)
    return CtrSpec(name="ctr", description=(
        f"DeepLight-like DeepFM CTR model on Criteo-shaped data: 26 fields, {rows:,} x {dim} embedding rows "
        f"({rows * dim * 4 / 1e6:.1f} MB), FM + MLP {26 * dim + 13}-256-128-1"),
        metric="accuracy", higher_is_better=True, lr=0.02, default_batch=512, scale=scale, seed=seed,
        vocab=vocab, dim=dim)


# ---------------------------------------------------------------------------------------------- ncf


class NcfModel(nn.Module):
    """NeuMF: GMF (elementwise product of user and item vectors) and an MLP tower, own tables each.

    Args:
        users: user rows.
        items: item rows.
        gmf_dim: GMF embedding dimension.
        mlp_dim: MLP embedding dimension (each of user and item).
        hidden: MLP tower sizes after the concatenated embeddings.
        sparse: sparse embedding gradients.
        std: standard deviation of the tables' initial values.
    """

    def __init__(self, users: int, items: int, gmf_dim: int, mlp_dim: int, hidden: Sequence[int],
                 sparse: bool, std: float) -> None:
        super().__init__()
        self.gmf_user = _embedding(users, gmf_dim, sparse, std=std)
        self.gmf_item = _embedding(items, gmf_dim, sparse, std=std)
        self.mlp_user = _embedding(users, mlp_dim, sparse, std=std)
        self.mlp_item = _embedding(items, mlp_dim, sparse, std=std)
        self.mlp = _mlp([2 * mlp_dim, *hidden], last_activation=True)
        self.out = nn.Linear(gmf_dim + hidden[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.gmf_user(users) * self.gmf_item(items)
        mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=1))
        return self.out(torch.cat([gmf, mlp], dim=1)).squeeze(1)


@dataclass(frozen=True)
class NcfSpec(ModelSpec):
    """The ``ncf`` model (NeuMF); see the module docstring for the data."""

    users: int = 250_000
    items: int = 50_000
    gmf_dim: int = 32
    mlp_dim: int = 64
    hidden: tuple[int, ...] = (128, 64, 32)
    user_zipf: float = 1.05
    item_zipf: float = 1.15
    factors: int = 16

    @cached_property
    def _world(self) -> tuple[_Zipf, torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, _TEACHER, 2)
        sampler = _Zipf([self.users, self.items], [self.user_zipf, self.item_zipf], permute=True, generator=g)
        n = self.users + self.items
        # Hidden factors and biases, indexed by global position (users first, then items).
        factors = torch.randn(n, self.factors, generator=g)
        bias = torch.randn(n, generator=g) * 0.5
        return sampler, factors, bias

    def _construct(self, sparse: bool) -> nn.Module:
        return NcfModel(self.users, self.items, self.gmf_dim, self.mlp_dim, self.hidden, sparse, self.init_std)

    def _batch(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        sampler, factors, bias = self._world
        pos = sampler.positions(batch_size, generator)
        u, i = pos[:, 0], pos[:, 1]
        score = 1.5 * (factors[u] * factors[i]).sum(1) / math.sqrt(self.factors) + bias[u] + bias[i]
        noise = torch.randn(batch_size, generator=generator) * 0.5
        labels = (score + noise > 0).float()
        ids = sampler.ids(pos)
        return ids[:, 0], ids[:, 1], labels

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        users, items, labels = batch
        return _binary(model, (users, items), labels)


def ncf(scale: float = 1.0, seed: int = 0) -> NcfSpec:
    """The ``ncf`` spec.

    Args:
        scale: factor on the user and item counts.
        seed: data seed.
    """
    _check_scale(scale)
    users, items = _scaled(250_000, scale, 16), _scaled(50_000, scale, 16)
    gmf, mlp = 32, 64
    mb = (users + items) * (gmf + mlp) * 4 / 1e6
    return NcfSpec(name="ncf", description=(
        f"NCF NeuMF recommendation model: {users:,} users x {items:,} items, GMF dim {gmf} + MLP dim {mlp} "
        f"tables ({mb:.1f} MB), MLP 128-64-32"),
        metric="accuracy", higher_is_better=True, lr=0.05, default_batch=1024, scale=scale, seed=seed, init_std=0.05,
        users=users, items=items, gmf_dim=gmf, mlp_dim=mlp)


# ----------------------------------------------------------------------------------------------- lm


class LmModel(nn.Module):
    """LSTM language model with a sampled-softmax output table (looked up, so its gradient is row-sparse).

    ``forward`` returns the logits of each position's target and of the shared negatives, before the
    log-Q correction (which needs the sampler, so the spec's ``loss`` applies it).

    Args:
        vocab: vocabulary size.
        dim: input embedding dimension.
        hidden: LSTM hidden size.
        proj: size of the LSTM output's linear projection (the output table's dimension, plus one bias
            column).
        sparse: sparse embedding gradients.
        std: standard deviation of the input table's initial values (the output table's is half).
    """

    def __init__(self, vocab: int, dim: int, hidden: int, proj: int, sparse: bool, std: float) -> None:
        super().__init__()
        self.embedding = _embedding(vocab, dim, sparse, std=std)
        # A projection after the LSTM rather than nn.LSTM(proj_size=): the same cost, and oneDNN (which
        # has no projected LSTM) instead of a fallback that warns on every rank.
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.proj = nn.Linear(hidden, proj)
        # One table holds weights and bias (last column): one sparse gradient instead of two.
        self.output = _embedding(vocab, proj + 1, sparse, std=std / 2)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor,
                negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.lstm(self.embedding(inputs))
        h = self.proj(h.reshape(-1, h.shape[-1]))
        h = torch.cat([h, h.new_ones(h.shape[0], 1)], dim=1)
        flat = targets.reshape(-1)
        # One lookup for targets and negatives: a dense-gradient table is then filled once, not twice.
        rows = self.output(torch.cat([flat, negatives]))
        true_logits = (h * rows[: flat.numel()]).sum(1)
        negative_logits = h @ rows[flat.numel():].t()
        return true_logits, negative_logits


@dataclass(frozen=True)
class LmSpec(ModelSpec):
    """The ``lm`` model (LSTM on One Billion Word); see the module docstring for the data."""

    vocab: int = 100_000
    dim: int = 128
    hidden: int = 256
    proj: int = 128
    seq_len: int = 20
    negatives: int = 1024
    zipf: float = 1.0
    successors: int = 32
    successor_zipf: float = 1.2
    noise: float = 0.1

    @cached_property
    def _world(self) -> tuple[_Zipf, torch.Tensor, torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, _TEACHER, 3)
        unigram = _Zipf([self.vocab], [self.zipf], permute=False, generator=g)
        successors = unigram.positions(self.vocab * self.successors, g).view(self.vocab, self.successors)
        rank_cdf = _zipf_cdf(self.successors, self.successor_zipf)
        # log of the expected count of each token among the negatives: the log-Q correction.
        probs = torch.diff(unigram.cdf, prepend=unigram.cdf.new_zeros(1))
        log_expected = (probs * self.negatives).log().float()
        return unigram, successors, rank_cdf, log_expected

    def _construct(self, sparse: bool) -> nn.Module:
        return LmModel(self.vocab, self.dim, self.hidden, self.proj, sparse, self.init_std)

    def _batch(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
        unigram, successors, rank_cdf, _ = self._world
        n = self.seq_len + 1
        fresh = unigram.positions(batch_size * n, generator).view(batch_size, n)
        u = torch.rand(batch_size, n, dtype=torch.float64, generator=generator)
        ranks = torch.searchsorted(rank_cdf, u, right=True).clamp_(max=self.successors - 1)
        jump = torch.rand(batch_size, n, generator=generator) < self.noise
        negatives = unigram.positions(self.negatives, generator).view(-1)
        # The chain is sequential in time; each step is vectorised over the batch (21 small steps).
        tokens = torch.empty(batch_size, n, dtype=torch.int64)
        tokens[:, 0] = fresh[:, 0]
        for t in range(1, n):
            nxt = successors[tokens[:, t - 1], ranks[:, t]]
            tokens[:, t] = torch.where(jump[:, t], fresh[:, t], nxt)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), negatives

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float]:
        inputs, targets, negatives = batch
        log_expected = self._world[3]
        true_logits, negative_logits = model(inputs, targets, negatives)
        flat = targets.reshape(-1)
        true_logits = true_logits - log_expected[flat]
        negative_logits = negative_logits - log_expected[negatives]
        # A negative that is the position's own target would count the target as its own competitor.
        negative_logits = negative_logits.masked_fill(negatives[None, :] == flat[:, None], float("-inf"))
        logits = torch.cat([true_logits[:, None], negative_logits], dim=1)
        loss = F.cross_entropy(logits, torch.zeros_like(flat))
        value = loss.item()
        # exp overflows a float past ~709: a diverged run reports inf instead of raising.
        return loss, math.exp(value) if value < 700.0 else math.inf


def lm(scale: float = 1.0, seed: int = 0) -> LmSpec:
    """The ``lm`` spec.

    Args:
        scale: factor on the vocabulary size.
        seed: data seed.
    """
    _check_scale(scale)
    vocab = _scaled(100_000, scale, 64)
    dim, hidden, proj = 128, 256, 128
    mb = vocab * (dim + proj + 1) * 4 / 1e6
    return LmSpec(name="lm", description=(
        f"LSTM LM like the paper's One Billion Word model: vocab {vocab:,}, input dim {dim}, LSTM {hidden} "
        f"-> {proj}, sampled softmax over 1,024 negatives ({mb:.1f} MB of tables)"),
        metric="perplexity", higher_is_better=False, lr=0.02, default_batch=32, scale=scale, seed=seed, init_std=0.1,
        vocab=vocab, dim=dim, hidden=hidden, proj=proj)


#: Model name -> spec factory (keyword options ``scale`` and ``seed``).
MODELS: dict[str, Callable[..., ModelSpec]] = {"ctr": ctr, "ncf": ncf, "lm": lm}


def get(name: str, scale: float = 1.0, seed: int = 0) -> ModelSpec:
    """The spec of model ``name``.

    Args:
        name: one of ``MODELS``.
        scale: factor on the embedding row counts, > 0.
        seed: data seed.

    Raises:
        ValueError: for an unknown name or a scale that is not positive.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choices: {', '.join(sorted(MODELS))}")
    return MODELS[name](scale=scale, seed=seed)
