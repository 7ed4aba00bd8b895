"""Offline calibration: attention-aware covariance targets -> rotations R = U·H·P -> fitted clip ratios.

1. Statistics (streaming, float64, memory independent of the token count). A registered attention function
   ("oscar_capture") sees the post-RoPE (and post q/k-norm) queries, keys and values of every full-attention layer
   while the model runs over the calibration sequences, and accumulates per (layer, KV head):
     - query:     Σ q qᵀ over the tokens and the GQA group's query heads       (key target, OSCAR)
     - key:       Σ k kᵀ                                                       (KᵀK ablation)
     - value:     Σ v vᵀ                                                       (VᵀV ablation)
     - attention: Σ_j w_j v_j v_jᵀ, w_j = Σ_i Σ_group S_ij², S the causal softmax probabilities, computed in query
                  blocks (never an N×N matrix)                                   (the paper's VᵀSᵀSV, OSCAR)
     - logit:     Σ_j w_j v_j v_jᵀ, w_j = k_jᵀ C_q k_j with C_q the same sequence's query second moment, normalised to
                  mean 1 (the reference code's weighting; it uses C_q over all tokens, which needs two passes)
     - Σ k, `[H_kv, d]`: the key mean μ (`CalibrationConfig.center_keys`; accumulated always, it costs nothing)
2. Rotations: eigenvectors of the chosen targets, composed with H and P (`rotation.build_rotation`), per KV head or
   shared per layer.
3. Clips: on held-out tokens (never used in step 1), per layer, the ratio in `clip_grid` that minimises the
   attention-output error when the keys (resp. values) outside the sink and recent window are clipped and quantized,
   exactly as the cache will store them: each head at its history bits, the wide heads (step 4) at 4 and unclipped
   (with `center_keys`, the held-out keys are centered by μ first).
4. Wide heads (`CalibrationConfig.wide_heads`): the model reads a random token sequence twice; the KV heads whose second
   reading attends most to the token after each token's first occurrence (the induction pattern by which a model
   retrieves what it has seen: `RetrievalProbe`) keep their history at 4 bits, as many as the bit budget pays for.
   The score needs no text, so it does not depend on the calibration domain.
5. Wide key channels (`CalibrationConfig.key_channel_bits="fitted"`): a key error e moves a query's logit by q·e, so the
   expected logit error is Σ_c E[q_c²]·E[e_c²] where the query second moment is diagonal, as it nearly is in the raw
   post-RoPE channels (each RoPE pair, averaged over positions, is a multiple of the identity). Per 2-bit (layer,
   KV head), the held-out queries give each raw channel its weight E[q_c²] (the GQA group pooled) and the held-out
   keys its squared error D_c(b) stored over the head's key blocks at b = 0, 2, 4 bits (0: the block mean); a greedy
   reverse water-filling gives the widths at 2 bits on average (`water_fill`), and the head's key rotation becomes
   the permutation that sorts its channels [4-bit | 2-bit | 0-bit] (`quant.quantize_wide_channels`).
"""

from __future__ import annotations

import contextlib
import math
import platform
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .config import CalibrationConfig, OscarConfig
from .data import load_texts, sequence_prefix, token_sequences
from .models import (ModelGeometry, UnsupportedModelError, check_attention_interface, decoder_attention,
                     model_geometry, text_config)
from .format import WIDE_BITS, StreamFormat, layer_format, wide_channel_permutation
from .quant import dequantize, fake_quantize_channels, quantize
from .rotation import build_rotation
from .rotations_io import FINGERPRINT_KEY, LAYOUT_FIELDS, OscarRotations, geometry_dict_for, weight_fingerprint

CAPTURE_NAME = "oscar_capture"
# Fewer KV heads than this in the OSCAR layers keep key_block everywhere: the allocation trusts one held-out sequence's
# errors, and with few heads each move is a large share of the budget. Gemma-3-270M (three global layers of one KV
# head) lost perplexity with it (20.03 vs 19.90 uniform; BF16 19.67) while models with 48-90 heads gained. Waived when
# the budget exceeds key_block everywhere (CalibrationConfig.allocation_key_bits): then no head gives up bits.
MIN_ALLOCATION_HEADS = 16
TARGETS = ("query", "key", "value", "attention", "logit")
_QUERY_BLOCK = 256
_capture = threading.local()


# ----------------------------------------------------------------------------------------------- statistics
@dataclass
class LayerStatistics:
    """Float64 accumulators of one layer, `[H_kv, d, d]` each, on the layer's device."""

    sums: dict[str, torch.Tensor]
    tokens: int = 0  # key/value tokens seen
    query_rows: int = 0  # query vectors seen per KV head (tokens × group size)
    key_sum: torch.Tensor | None = None  # Σ k `[H, d]` float64

    def target(self, name: str) -> torch.Tensor:
        """The normalised second-moment target `[H, d, d]` (float64, on the CPU)."""
        count = self.query_rows if name == "query" else self.tokens
        return (self.sums[name] / max(count, 1)).cpu()

    def key_mean(self) -> torch.Tensor:
        """The mean post-RoPE key μ `[H, d]` (float64, on the CPU)."""
        if self.key_sum is None:
            raise ValueError("these calibration statistics carry no key sum (made by an older oscar-hf?): recalibrate")
        return (self.key_sum / max(self.tokens, 1)).cpu()


def attention_column_energy(query: torch.Tensor, key: torch.Tensor, scale: float, block: int = _QUERY_BLOCK) -> torch.Tensor:
    """w_j = Σ_i Σ_(query heads of the group) S_ij² for causal softmax S; returns `[B, H_kv, T]` float64.

    Args:
        query: `[B, Hq, T, d]`; key: `[B, H_kv, T, d]` (no padding; causal).
    """
    b, hq, t, d = query.shape
    h = key.shape[1]
    g = hq // h
    q = query.float().reshape(b, h, g, t, d)
    k = key.float()
    energy = torch.zeros(b, h, t, dtype=torch.float64, device=query.device)
    positions = torch.arange(t, device=query.device)
    for start in range(0, t, block):
        end = min(start + block, t)
        scores = torch.einsum("bhgid,bhjd->bhgij", q[:, :, :, start:end], k[:, :, :end]) * scale
        causal = positions[:end].unsqueeze(0) <= positions[start:end].unsqueeze(1)  # [i, j]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        energy[:, :, :end] += probs.square().sum(dim=(2, 3)).double()
    return energy


class StatisticsCollector:
    """Accumulates `LayerStatistics` for the OSCAR layers; optionally records one held-out pass."""

    def __init__(self, geometry: ModelGeometry):
        self.geometry = geometry
        self.layers: dict[int, LayerStatistics] = {}
        self.record: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] | None = None
        self.scales: dict[int, float] = {}

    def observe(self, layer_idx: int, query, key, value, attention_mask, scale: float) -> None:
        if layer_idx not in self.geometry.oscar_layers:
            return
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not torch.isfinite(t).all():
                raise ValueError(f"calibration: layer {layer_idx} produced non-finite {name} states (NaN/Inf)")
        self.scales[layer_idx] = scale
        if self.record is not None:
            self.record[layer_idx] = (query[0].detach().float(), key[0].detach().float(), value[0].detach().float(), scale)
            return
        b, hq, t, d = query.shape
        h = key.shape[1]
        g = hq // h
        stats = self.layers.get(layer_idx)
        if stats is None:
            zeros = lambda: torch.zeros(h, d, d, dtype=torch.float64, device=query.device)  # noqa: E731
            stats = self.layers[layer_idx] = LayerStatistics(
                {name: zeros() for name in TARGETS}, key_sum=torch.zeros(h, d, dtype=torch.float64, device=query.device)
            )
        q = query.double().reshape(b, h, g * t, d)
        k, v = key.double(), value.double()
        s = stats.sums
        s["query"] += torch.einsum("bhnd,bhne->hde", q, q)
        s["key"] += torch.einsum("bhnd,bhne->hde", k, k)
        stats.key_sum += k.sum(dim=(0, 2))
        s["value"] += torch.einsum("bhnd,bhne->hde", v, v)
        w_attn = attention_column_energy(query, key, scale)
        s["attention"] += torch.einsum("bhn,bhnd,bhne->hde", w_attn, v, v)
        c_q = torch.einsum("bhnd,bhne->hde", q, q) / (b * g * t)
        w_logit = torch.einsum("bhnd,hde,bhne->bhn", k, c_q, k)
        w_logit = w_logit / w_logit.mean(dim=(0, 2), keepdim=True).clamp(min=1e-300)
        s["logit"] += torch.einsum("bhn,bhnd,bhne->hde", w_logit, v, v)
        stats.tokens += b * t
        stats.query_rows += b * g * t


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    collector: StatisticsCollector | None = getattr(_capture, "collector", None)
    if collector is not None and id(module) in _capture.modules:  # the language model's layers, not a vision tower's
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        collector.observe(module.layer_idx, query, key, value, attention_mask, scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _register_capture() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_NAME, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@contextlib.contextmanager
def capturing(model, collector: "StatisticsCollector | RetrievalProbe"):
    """Runs `model` with the capture attention; restores its attention implementation afterwards."""
    _register_capture()
    previous = text_config(model.config)._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    _capture.collector = collector
    _capture.modules = {id(module) for _, module in decoder_attention(model).values()}
    try:
        yield
    finally:
        _capture.collector, _capture.modules = None, set()
        model.set_attn_implementation(previous)


def _run(model, sequences, progress, description) -> None:
    device = _input_device(model)
    iterator = sequences
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(sequences, desc=description, unit="seq")
    with torch.no_grad():
        for ids in iterator:
            model(input_ids=ids.unsqueeze(0).to(device), use_cache=False)


def _input_device(model) -> torch.device:
    embeddings = model.get_input_embeddings()
    return embeddings.weight.device if embeddings is not None else next(model.parameters()).device


# ----------------------------------------------------------------------------------------------- rotations
@dataclass(frozen=True)
class RotationTargets:
    """How the rotations are built from the statistics: OSCAR's (`RotationTargets()`) or an ablation's.

    key_target: covariance whose eigenvectors rotate keys: "query" (GQA-pooled query second moment, OSCAR), "key"
    (KᵀK), "hadamard" (data-free H·P), "identity". value_target: "attention" (the paper's VᵀSᵀSV), "logit" (the
    reference code's weighting), "value" (VᵀV), "hadamard", "identity". per_head: one rotation per (layer, KV head),
    or one per layer. hadamard, permutation: the H and P factors of R = U·H·P."""

    key_target: str = "query"
    value_target: str = "attention"
    per_head: bool = True
    hadamard: bool = True
    permutation: bool = True

    def __post_init__(self):
        if self.key_target not in ("query", "key", "hadamard", "identity"):
            raise ValueError(f"RotationTargets.key_target: unknown target {self.key_target!r}")
        if self.value_target not in ("attention", "logit", "value", "hadamard", "identity"):
            raise ValueError(f"RotationTargets.value_target: unknown target {self.value_target!r}")

    def describe(self) -> dict:
        return {"key_target": self.key_target, "value_target": self.value_target, "per_head": self.per_head,
                "composition": "U" + ("·H" if self.hadamard else "") + ("·P" if self.permutation else "")}


def rotations_from_statistics(stats: LayerStatistics, targets: RotationTargets = RotationTargets(),
                              center_keys: bool = False) -> dict[str, torch.Tensor]:
    """Key/value rotations `[H, d, d]` and eigenvalues `[H, d]` (float64) for one layer."""
    out = {}
    for which, target_name in (("key", targets.key_target), ("value", targets.value_target)):
        h, d = stats.sums["query"].shape[:2]
        data_free = target_name in ("hadamard", "identity")
        if data_free:
            covariances = torch.eye(d, dtype=torch.float64).expand(h, d, d)
        else:
            covariances = stats.target(target_name)
            if target_name == "key" and center_keys:
                mu = stats.key_mean()  # the cache stores k − μ: rotate by the eigenvectors of their covariance
                covariances = covariances - torch.einsum("hd,he->hde", mu, mu)
            if not targets.per_head:
                covariances = covariances.mean(0, keepdim=True).expand(h, d, d)
        rots, eigs = [], []
        for head in range(h):
            r, lam = build_rotation(
                covariances[head],
                use_eigenvectors=not data_free,
                use_hadamard=targets.hadamard and target_name != "identity",
                use_permutation=targets.permutation and target_name != "identity",
            )
            rots.append(r)
            eigs.append(lam)
        out[f"{which}_rotation"] = torch.stack(rots)
        out[f"{which}_eigenvalues"] = torch.stack(eigs)
    return out


# ----------------------------------------------------------------------------------------------- clip fitting
def _exact_mask(t: int, sink: int, window: int, device) -> torch.Tensor:
    """[i, j]: True where query i sees key j in full precision in the cache (sink, recent window, itself)."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(t, device=device).unsqueeze(0)
    return (j < sink) | (i - j < window + 1)


def clip_errors(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_rotation: torch.Tensor,
    value_rotation: torch.Tensor,
    scale: float,
    config: OscarConfig,
    ratios,
    head_bits=None,
) -> dict[str, dict[float, float]]:
    """Relative attention-output error for each clip ratio, for keys and for values of one layer.

    Args:
        query `[Hq, T, d]`, key/value `[H, T, d]` (one held-out sequence), rotations `[H, d, d]`, head_bits: the
        history bits of each KV head (2, or `WIDE_BITS` for a wide head; None: `config.bits` everywhere).
    Returns:
        `{"key": {ratio: err}, "value": {ratio: err}}` where err = Σ‖o − ô‖² / Σ‖o‖² over the queries that see
        quantized history and every head of the layer, quantizing only keys (resp. values) that the cache would hold
        quantized, each head at its bits.
    """
    hq, t, d = query.shape
    h = key.shape[0]
    g = hq // h
    kr = torch.matmul(key.float(), key_rotation.float())
    vr = torch.matmul(value.float(), value_rotation.float())
    qr = torch.matmul(query.float().reshape(h, g, t, d), key_rotation.float().unsqueeze(1))  # [H, g, T, d]
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    exact = _exact_mask(t, config.sink_tokens, config.window_tokens, query.device) & causal
    quant = causal & ~exact
    rows = quant.any(1)  # queries that see quantized history
    if not rows.any():
        raise ValueError(
            f"heldout_tokens ({t}) must exceed sink_tokens + window_tokens ({config.sink_tokens + config.window_tokens}) "
            "so that the clip fit sees quantized history"
        )
    qr = qr[:, :, rows]  # only queries that see quantized history can have an error
    causal, exact, quant = causal[rows], exact[rows], quant[rows]

    def attend(scores):
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)

    scores = torch.einsum("hgid,hjd->hgij", qr, kr) * scale
    probs = attend(scores)
    reference = torch.einsum("hgij,hjd->hgid", probs, vr)
    norm = reference.square().sum().item()
    probs_quant = probs * quant
    errors: dict[str, dict[float, float]] = {"key": {}, "value": {}}

    def key_error(k_hat):
        scores_hat = torch.where(exact, scores, torch.einsum("hgid,hjd->hgij", qr, k_hat) * scale)
        out = torch.einsum("hgij,hjd->hgid", attend(scores_hat), vr)
        return (out - reference).square().sum().item() / norm

    # Channel-wise keys are not clipped: every ratio gives the same error (ratio 1.0 wins the tie), computed once.
    channel_error = key_error(_quantized_keys(kr, config, head_bits=head_bits)) \
        if config.key_granularity == "channel" else None
    for ratio in ratios:
        errors["key"][ratio] = channel_error if channel_error is not None else key_error(
            _quantized_keys(kr, config, ratio, head_bits))
        # Quantizing values changes the output by P_quant·(v̂ − v).
        values = layer_format(config, h, d, value_clip=ratio, head_bits=head_bits).values
        v_delta = _stored(vr, values) - vr
        errors["value"][ratio] = torch.einsum("hgij,hjd->hgid", probs_quant, v_delta).square().sum().item() / norm
    return errors


def key_basis_candidates(calibrated: torch.Tensor) -> dict[str, torch.Tensor]:
    """The key rotations a (layer, KV head) may keep, `{name: [H, d, d]}` float64: the calibrated one, the data-free
    H·P and none. Which basis quantizes best depends on the model: channel-wise keys of Qwen2.5 (k_proj bias, hence
    large slowly-rotating RoPE components) want the raw basis, where a rotation would mix fast and slow channels;
    SmolLM2's keys gain from the calibrated one."""
    h, d = calibrated.shape[:2]
    eye = torch.eye(d, dtype=torch.float64).expand(h, d, d)
    return {"calibrated": calibrated.double(), "hadamard": build_rotation(eye[0], use_eigenvectors=False)[0].expand(h, d, d),
            "identity": eye}


def key_basis_errors(query, key, value, candidates: dict[str, torch.Tensor], scale: float,
                     config: OscarConfig, head_bits=None) -> dict[str, torch.Tensor]:
    """Relative attention-output error per KV head `[H]` of each candidate key rotation, on one held-out sequence
    (query `[Hq, T, d]`, key/value `[H, T, d]`), keys quantized as the cache will, each head at its `head_bits`
    (None: `config.bits` everywhere; values exact, so only the keys count). Keys outside the history (sink, recent
    window, the query itself) stay exact, as in `clip_errors`."""
    hq, t, d = query.shape
    h = key.shape[0]
    g = hq // h
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    exact = _exact_mask(t, config.sink_tokens, config.window_tokens, query.device) & causal
    rows = (causal & ~exact).any(1)
    if not rows.any():
        raise ValueError(f"heldout_tokens ({t}) must exceed sink_tokens + window_tokens so that keys are quantized")
    causal, exact = causal[rows], exact[rows]
    v = value.float()
    out = {}
    for name, rotation in candidates.items():
        kr = torch.matmul(key.float(), rotation.float())
        qr = torch.matmul(query.float().reshape(h, g, t, d), rotation.float().unsqueeze(1))[:, :, rows]
        scores = torch.einsum("hgid,hjd->hgij", qr, kr) * scale
        k_hat = _quantized_keys(kr, config, head_bits=head_bits)
        scores_hat = torch.where(exact, scores, torch.einsum("hgid,hjd->hgij", qr, k_hat) * scale)
        reference = torch.einsum("hgij,hjd->hgid", torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)
        approx = torch.einsum("hgij,hjd->hgid", torch.softmax(scores_hat.masked_fill(~causal, float("-inf")), -1), v)
        out[name] = (approx - reference).square().sum(dim=(1, 2, 3)) / reference.square().sum(dim=(1, 2, 3))
    return out


def _stored(rows: torch.Tensor, fmt: StreamFormat) -> torch.Tensor:
    """Rows `[H, T, d]` as the history stream `fmt` gives them back: `quant.quantize`, then `quant.dequantize`."""
    return dequantize(quantize(rows[None], fmt))[0]


def _quantized_keys(kr: torch.Tensor, config: OscarConfig, ratio: float = 1.0, head_bits=None) -> torch.Tensor:
    """Keys `[H, T, d]` as the cache stores them in its history (the caller masks what stays exact), each head at
    its `head_bits` (None: `config.bits`), channel-wise keys in blocks of `config.key_block` within whole demotion
    blocks, token-wise keys clipped at `ratio`."""
    h, t, d = kr.shape
    keys = layer_format(config, h, d, key_clip=ratio, head_bits=head_bits).keys
    if not keys.channelwise:
        return _stored(kr, keys)
    start = min(config.sink_tokens, t)
    end = start + (t - start) // config.demotion_block * config.demotion_block
    out = kr.clone()
    if end > start:
        out[:, start:end] = _stored(kr[:, start:end], keys)
    return out


def choose_key_basis(candidates: dict[str, torch.Tensor], errors: dict[str, torch.Tensor],
                     per_head: bool = True) -> tuple[torch.Tensor, list[str]]:
    """Per KV head (or for the whole layer, summing the heads' errors, when rotations are shared per layer), the
    candidate with the lowest error (ties to the earlier candidate); returns `([H, d, d], names per head)`."""
    names = list(candidates)
    table = torch.stack([errors[n] for n in names])  # [candidates, H]
    if not per_head:
        table = table.sum(1, keepdim=True).expand_as(table)
    best = table.argmin(0).tolist()
    rotation = torch.stack([candidates[names[c]][head] for head, c in enumerate(best)])
    return rotation, [names[c] for c in best]


def key_block_errors(query, key, value, rotation: torch.Tensor, scale: float, config: OscarConfig,
                     choices, head_bits=None) -> dict[int, torch.Tensor]:
    """Held-out relative attention-output error per KV head `[H]` of keys stored in the basis `rotation` `[H, d, d]`
    over blocks of each of `choices` tokens, each head at its `head_bits` (`key_basis_errors` with that block
    everywhere)."""
    return {block: key_basis_errors(query, key, value, {"stored": rotation}, scale,
                                    config.replace(key_block=block), head_bits)["stored"]
            for block in choices}


def allocate_key_blocks(errors: dict[int, dict[int, torch.Tensor]], config: OscarConfig, choices,
                        key_bits: float | None = None) -> dict[int, tuple[int, ...]]:
    """The channel-wise key block of every (layer, KV head), `{layer: (block, ...)}`, that minimises the summed
    held-out error `errors[layer][block][head]` over the blocks `choices`, with at most `key_bits` average key bits
    per element (default: the metadata of `config.key_block` everywhere; calibration passes
    `CalibrationConfig.allocation_key_bits`).

    Exact (a multiple-choice knapsack by dynamic programming): a head with block b costs demotion_block / b
    (scale, minimum) rows per demotion block, and the budget is the count those bits pay for. Unlike a greedy, it
    keeps uniform blocks when moving bits between few heads does not pay (Gemma 3 has one KV head in each of three
    global layers)."""
    chunk = config.demotion_block
    units = [(layer, head) for layer in sorted(errors) for head in range(len(next(iter(errors[layer].values()))))]
    if key_bits is None:
        budget = len(units) * chunk // config.key_block
    else:  # rows of 2 * meta_bits per channel each add 2 * meta_bits / chunk bits per key element
        budget = int(len(units) * (key_bits - config.bits) * chunk / (2 * config.meta_bits) + 1e-9)
    coarsest = chunk // max(choices)
    if budget < len(units) * coarsest:
        raise ValueError(f"a key budget of {key_bits} bits per element is below the coarsest key block "
                         f"({max(choices)} tokens, {config.bits + 2 * config.meta_bits / max(choices):g} bits): "
                         "raise CalibrationConfig.allocation_history_bits")
    choices = sorted(choices)  # finest first
    inf = float("inf")
    best = [0.0] + [inf] * budget  # best[c]: least error of the units so far using exactly c rows
    picks = []
    for layer, head in units:
        new, pick = [inf] * (budget + 1), [0] * (budget + 1)
        for c in range(budget + 1):
            if best[c] == inf:
                continue
            for block in choices:
                cost = c + chunk // block
                err = best[c] + float(errors[layer][block][head])
                if cost <= budget and err < new[cost] - 1e-15:
                    new[cost], pick[cost] = err, block
        best = new
        picks.append(pick)
    c = min(range(budget + 1), key=lambda i: (best[i], i))
    chosen = {}
    for (layer, head), pick in zip(reversed(units), reversed(picks)):
        chosen[(layer, head)] = pick[c]
        c -= chunk // pick[c]
    return {layer: tuple(chosen[(layer, h)] for h in range(len(next(iter(errors[layer].values())))))
            for layer in sorted(errors)}


# ----------------------------------------------------------------------------------------------- wide heads
RETRIEVAL_SPAN = 256  # random tokens read twice
RETRIEVAL_SEEDS = (0, 1)


class RetrievalProbe:
    """Per (layer, KV head) of the OSCAR layers, the retrieval score `[H_kv]`: over a sequence [prefix | A | A] of
    random tokens A (`span` of them), the mean attention probability that a token of the second A pays to the token
    after its own first occurrence (where a copying model finds what comes next); a KV head takes the largest of
    its query heads, averaged over the sequences read (`observe` is called by the capture attention)."""

    def __init__(self, geometry: ModelGeometry, prefix: int, span: int = RETRIEVAL_SPAN):
        self.geometry, self.prefix, self.span = geometry, prefix, span
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def observe(self, layer_idx: int, query, key, value, attention_mask, scale: float) -> None:
        if layer_idx not in self.geometry.oscar_layers:
            return
        hq, h = query.shape[1], key.shape[1]
        rows = torch.arange(self.prefix + self.span, self.prefix + 2 * self.span - 1, device=query.device)
        keys = key[0].float().repeat_interleave(hq // h, dim=0)  # [Hq, n, d]
        logits = torch.einsum("hrd,hnd->hrn", query[0, :, rows].float(), keys) * scale
        positions = torch.arange(keys.shape[1], device=query.device)
        logits = logits.masked_fill(positions[None, None, :] > rows[None, :, None], float("-inf"))
        target = (rows - self.span + 1)[None, :, None].expand(hq, -1, 1)
        hit = logits.softmax(-1).gather(-1, target).squeeze(-1).mean(-1)  # [Hq]
        score = hit.view(h, hq // h).amax(-1).double().cpu()
        self.sums[layer_idx] = self.sums.get(layer_idx, 0) + score
        self.counts[layer_idx] = self.counts.get(layer_idx, 0) + 1

    @property
    def scores(self) -> dict[int, torch.Tensor]:
        return {layer: (total / self.counts[layer]).float() for layer, total in sorted(self.sums.items())}


def retrieval_sequences(model, tokenizer, span: int = RETRIEVAL_SPAN, seeds=RETRIEVAL_SEEDS):
    """The probe's inputs: `(prefix length, span, sequences)`, each sequence the tokenizer's prefix and `span` random
    non-special tokens read twice (span shortened to fit the model's positions), one per seed."""
    prefix = sequence_prefix(tokenizer)
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(min(len(tokenizer), text_config(model.config).vocab_size)) if t not in special])
    max_positions = getattr(text_config(model.config), "max_position_embeddings", None)
    if max_positions is not None:
        span = min(span, (max_positions - len(prefix)) // 2)
    sequences = []
    for seed in seeds:
        body = vocab[torch.randint(len(vocab), (span,), generator=torch.Generator().manual_seed(seed))]
        sequences.append(torch.cat([torch.tensor(prefix, dtype=torch.long), body, body]))
    return len(prefix), span, sequences


def retrieval_scores(model, tokenizer, span: int = RETRIEVAL_SPAN, seeds=RETRIEVAL_SEEDS) -> dict[int, torch.Tensor]:
    """`{layer: [H_kv]}` retrieval scores of the OSCAR layers (`RetrievalProbe`), from `len(seeds)` random sequences."""
    geometry = model_geometry(model.config)
    prefix, span, sequences = retrieval_sequences(model, tokenizer, span, seeds)
    probe = RetrievalProbe(geometry, prefix, span)
    was_training = model.training
    model.eval()
    try:
        with capturing(model, probe):
            _run(model, sequences, False, "retrieval probe")
    finally:
        model.train(was_training)
    return probe.scores


def allocate_wide_heads(scores: dict[int, torch.Tensor], config: OscarConfig, head_dim: int, budget: float,
                        key_blocks: dict[int, tuple[int, ...]] | None = None,
                        key_bits: float | None = None) -> dict[int, tuple[int, ...]] | None:
    """`{layer: (history bits per KV head, ...)}`: the heads with the highest retrieval score at `quant.WIDE_BITS`,
    as many as raise the history (keys and values averaged over every head) to at most `budget` bits per element
    (`CalibrationConfig.wide_budget`): a wide head costs WIDE_BITS − bits more on both streams. The keys cost
    `key_bits` per element on average when given (a block allocation still to come spends at most that), else those
    of `key_blocks` (default: key_block everywhere). None when the budget pays for none."""
    units = [(layer, h) for layer in sorted(scores) for h in range(len(scores[layer]))]
    if not units:
        return None
    if key_bits is None:
        key_bits = sum(config.bits + 2 * config.meta_bits / (key_blocks[layer][h] if key_blocks else config.key_block)
                       for layer, h in units) / len(units)
    history = (key_bits + config.value_bits(head_dim)) / 2
    count = int((budget - history) * len(units) / (WIDE_BITS - config.bits) + 1e-9)
    if count <= 0:
        return None
    chosen = set(sorted(units, key=lambda u: (-float(scores[u[0]][u[1]]), u))[:count])
    return {layer: tuple(WIDE_BITS if (layer, h) in chosen else config.bits for h in range(len(scores[layer])))
            for layer in sorted(scores)}


def _raw_channels_unless_wide(rotation: torch.Tensor, names: list[str] | None,
                              wide: list[bool]) -> tuple[torch.Tensor, list[str]]:
    """Key rotations `[H, d, d]` (float64) with every head but the `wide` ones back to the identity, and their names:
    a 2-bit head with fitted key channels stores its raw channels (the permutation comes later)."""
    h, d = rotation.shape[:2]
    wide = list(wide) or [False] * h
    names = names or ["calibrated"] * h
    eye = torch.eye(d, dtype=torch.float64)
    rotation = torch.stack([r if w else eye for r, w in zip(rotation.double().cpu(), wide)])
    return rotation, [n if w else "identity" for n, w in zip(names, wide)]


def best_ratio(errors: dict[float, float]) -> float:
    """Smallest error; ties go to the larger ratio (less clipping)."""
    return min(errors, key=lambda r: (round(errors[r], 12), -r))


# ----------------------------------------------------------------------------------------------- entry point
def calibration_sequences(tokenizer, calibration: CalibrationConfig, data=None):
    """The calibration sequences and the held-out sequence (after them, disjoint): `(sequences, heldout, data_info)`."""
    documents, data_info = load_texts(data)
    seq_len = calibration.sequence_length
    n_seq = math.ceil(calibration.tokens / seq_len)
    sequences = token_sequences(tokenizer, documents, seq_len, n_seq)
    heldout = []
    if calibration.heldout_tokens:
        offset = n_seq * (seq_len - len(sequence_prefix(tokenizer)))
        heldout = token_sequences(tokenizer, documents, calibration.heldout_tokens, 1, offset=offset)
    return sequences, heldout, data_info


# ----------------------------------------------------------------------------------------------- wide key channels
CHANNEL_WIDTHS = (0, 2, WIDE_BITS)  # the key channel widths the storage format holds (quant.py, "wide key channels")


def channel_width_errors(keys: torch.Tensor, blocks, scale_dtype: str = "float16") -> torch.Tensor:
    """Mean squared error `[H, d, len(CHANNEL_WIDTHS)]` (float64) of each channel of keys `[H, T, d]` (T a multiple
    of every block) stored channel-wise over head h's blocks of `blocks[h]` tokens at each width (0 bits: the block
    mean, rounded to the meta dtype like the stored one)."""
    out = []
    for head, block in enumerate(blocks):
        k = keys[head].float()
        t, d = k.shape
        mean = k.reshape(t // block, block, d).mean(1, keepdim=True).to(getattr(torch, scale_dtype)).float()
        errs = [(mean - k.reshape(t // block, block, d)).square().mean((0, 1))]
        errs += [(fake_quantize_channels(k, b, block, scale_dtype).float() - k).square().mean(0) for b in CHANNEL_WIDTHS[1:]]
        out.append(torch.stack(errs, -1))
    return torch.stack(out).double()


def water_fill(weights: torch.Tensor, errors: torch.Tensor, budget: int, widths=CHANNEL_WIDTHS) -> torch.Tensor:
    """Greedy reverse water-filling: channel widths `[d]` (values of `widths`, increasing from 0; `errors[c, i]` is
    channel c's squared error at `widths[i]` bits) summing to at most `budget` bits that make
    Σ_c weights_c·errors[c, width_c] small: from 0 bits everywhere, each step raises the one channel (to any wider
    width: 1 bit can be worse than 0) with the largest weighted error drop per bit spent."""
    widths = torch.tensor(tuple(widths))
    if widths[0] != 0 or errors.shape[-1] != len(widths):
        raise ValueError(f"widths {widths.tolist()} must start at 0 and match the errors' {errors.shape[-1]} columns")
    cost = weights.double()[:, None] * errors.double()  # [d, W]
    level = torch.zeros(weights.shape[0], dtype=torch.long)  # index into widths
    spent = 0
    while True:
        step = widths[None, :] - widths[level][:, None]
        rate = (cost.gather(1, level[:, None]) - cost) / step.clamp(min=1)
        rate = torch.where((step > 0) & (step <= budget - spent), rate, torch.full_like(rate, -float("inf")))
        best = int(rate.argmax())
        channel, choice = divmod(best, len(widths))
        if rate[channel, choice] == -float("inf"):
            return widths[level]
        spent += int(step[channel, choice])
        level[channel] = choice


def allocate_wide_channels(query: torch.Tensor, key: torch.Tensor, blocks, config: OscarConfig,
                           head_bits=None) -> tuple[tuple[int, ...], torch.Tensor | None, torch.Tensor]:
    """One layer's wide key channels from one held-out sequence (query `[Hq, T, d]`, key `[H, T, d]` post-RoPE, raw
    channels; centered if the cache centers): `(n per KV head, permutations [H, d, d] float64 or None for a head
    left alone — the wide heads —, channel widths [H, d])`. Weights E[q_c²] pool the GQA group; errors come from the
    keys the history would hold (after the sink, whole demotion blocks), at 2 bits per channel on average."""
    hq, t, d = query.shape
    h = key.shape[0]
    start = min(config.sink_tokens, t)
    end = start + (t - start) // config.demotion_block * config.demotion_block
    if end == start:
        raise ValueError(f"heldout_tokens ({t}) must cover a demotion block ({config.demotion_block}) after the sink "
                         "for the key channel widths")
    weights = query.double().reshape(h, hq // h, t, d).square().mean((1, 2)).cpu()
    errors = channel_width_errors(key[:, start:end], blocks, config.scale_dtype).cpu()
    counts, perms, widths = [], [], []
    for head in range(h):
        if head_bits is not None and head_bits[head] == WIDE_BITS:
            counts.append(0)
            perms.append(None)
            widths.append(torch.full((d,), WIDE_BITS))
            continue
        bits = water_fill(weights[head], errors[head], config.bits * d)
        n, perm = wide_channel_permutation(bits)
        counts.append(n)
        perms.append(perm)
        widths.append(bits)
    return tuple(counts), perms, torch.stack(widths)


@dataclass
class CalibrationReport:
    seconds: float
    tokens: int
    heldout_tokens: int
    key_clips: dict[int, float] | None
    value_clips: dict[int, float] | None
    clip_errors: dict[int, dict] = field(default_factory=dict)
    key_blocks: dict[int, tuple[int, ...]] | None = None
    head_bits: dict[int, tuple[int, ...]] | None = None
    key_wide_channels: dict[int, tuple[int, ...]] | None = None

    def summary(self, fixed=(0.96, 0.92)) -> str:
        lines = [f"calibrated on {self.tokens} tokens (+{self.heldout_tokens} held out) in {self.seconds:.1f} s"]
        if self.key_blocks:
            blocks = [b for per_layer in self.key_blocks.values() for b in per_layer]
            counts = ", ".join(f"{blocks.count(b)} x {b}" for b in sorted(set(blocks)))
            lines.append(f"key blocks per KV head (tokens): {counts}")
        if self.head_bits:
            wide = [f"{layer}.{h}" for layer, bits in self.head_bits.items() for h, b in enumerate(bits) if b == WIDE_BITS]
            lines.append(f"wide heads at {WIDE_BITS} bits (layer.head): {', '.join(wide)}")
        if self.key_wide_channels:
            counts = [n for per_layer in self.key_wide_channels.values() for n in per_layer]
            lines.append(f"wide key channels: {sum(counts)} channels at {WIDE_BITS} bits and as many at 0, in "
                         f"{sum(n > 0 for n in counts)} of {len(counts)} KV heads (at most {max(counts)} in one)")
        if self.key_clips:
            lines.append("layer | key clip | key err (fitted / none / 0.96) | value clip | value err (fitted / none / 0.92)")
            for layer, curves in sorted(self.clip_errors.items()):
                ke, ve = curves["key"], curves["value"]
                kc, vc = self.key_clips[layer], self.value_clips[layer]
                lines.append(
                    f"{layer:5d} | {kc:8.2f} | {ke[kc]:.4f} / {ke.get(1.0, float('nan')):.4f} / {ke.get(fixed[0], float('nan')):.4f}"
                    f" | {vc:10.2f} | {ve[vc]:.4f} / {ve.get(1.0, float('nan')):.4f} / {ve.get(fixed[1], float('nan')):.4f}"
                )
            kcs, vcs = list(self.key_clips.values()), list(self.value_clips.values())
            lines.append(f"mean fitted clip: keys {sum(kcs) / len(kcs):.3f}, values {sum(vcs) / len(vcs):.3f}")
        return "\n".join(lines)


def _check_token_ids(model, sequences: list[torch.Tensor]) -> None:
    """Refuses token ids beyond the model's input embeddings (a tokenizer of another model), which would otherwise
    fail as an index error deep inside the embedding."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return
    top = max((int(s.max()) for s in sequences if s.numel()), default=-1)
    if top >= rows:
        raise ValueError(f"the tokenizer gives token id {top}, but the model's input embeddings have {rows} rows: "
                         "is the tokenizer for another model?")


def calibrate(
    model,
    tokenizer,
    data=None,
    config: OscarConfig | None = None,
    calibration: CalibrationConfig | None = None,
    progress: bool = True,
    statistics: dict[int, LayerStatistics] | None = None,
    targets: RotationTargets = RotationTargets(),
) -> OscarRotations:
    """Calibrates OSCAR rotations (and fitted clips, key blocks, wide heads and key channel widths) for `model` on
    `data` (see `data.load_texts`), for the storage layout `config` (default `OscarConfig()`), as `calibration` says
    (default `CalibrationConfig()`).

    Returns `OscarRotations`; `rotations.metadata["calibration"]` records the data, token counts and time, and
    `rotations.report` holds a `CalibrationReport` (printable with `.summary()`). Pass `statistics` (from an earlier
    run's `rotations.statistics`) to rebuild rotations for another config without running the model again; `targets`
    builds the rotations another way (the evaluation's ablations).
    """
    config = config or OscarConfig()
    calibration = calibration or CalibrationConfig()
    for name, value, kind in (("config", config, "an OscarConfig"), ("calibration", calibration, "a CalibrationConfig")):
        if not isinstance(value, OscarConfig if name == "config" else CalibrationConfig):
            raise TypeError(f"calibrate: {name} must be {kind} (or None), got {type(value).__name__}")
    calibration.check_for(config)
    check_attention_interface(model)
    geometry = model_geometry(model.config)
    config.check_head_dim(geometry.head_dim)
    if calibration.heldout_tokens and calibration.heldout_tokens <= config.sink_tokens + config.window_tokens:
        raise ValueError(
            f"CalibrationConfig.heldout_tokens: {calibration.heldout_tokens} must exceed sink_tokens + window_tokens "
            f"({config.sink_tokens + config.window_tokens}) for the clip fit to see quantized history"
        )
    start = time.perf_counter()
    seq_len = calibration.sequence_length
    max_positions = getattr(text_config(model.config), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"CalibrationConfig.sequence_length {seq_len} exceeds the model's {max_positions} positions")
    if calibration.tokens < seq_len:
        raise ValueError(f"CalibrationConfig.tokens {calibration.tokens} is less than one calibration sequence "
                         f"({seq_len} tokens, CalibrationConfig.sequence_length)")
    sequences, heldout, data_info = calibration_sequences(tokenizer, calibration, data)
    _check_token_ids(model, sequences + heldout)
    used_tokens = sum(len(s) for s in sequences)

    collector = StatisticsCollector(geometry)
    was_training = model.training
    model.eval()
    try:
        with capturing(model, collector):
            if statistics is None:
                _run(model, sequences, progress, "OSCAR calibration")
            else:
                collector.layers = statistics
            if heldout:
                collector.record = {}
                _run(model, heldout, False, "held-out")
    finally:
        model.train(was_training)
    missing = [i for i in geometry.oscar_layers if i not in collector.layers]
    if missing:
        raise UnsupportedModelError(
            f"layers {missing} never called the attention interface during calibration: this model computes "
            "attention outside transformers' AttentionInterface, so OSCAR cannot attach to it"
        )

    key_rotations, value_rotations, key_eigs, value_eigs = {}, {}, {}, {}
    for layer in geometry.oscar_layers:
        built = rotations_from_statistics(collector.layers[layer], targets, calibration.center_keys)
        key_rotations[layer], value_rotations[layer] = built["key_rotation"], built["value_rotation"]
        key_eigs[layer], value_eigs[layer] = built["key_eigenvalues"], built["value_eigenvalues"]

    key_means = None
    if calibration.center_keys:
        key_means = {layer: collector.layers[layer].key_mean() for layer in geometry.oscar_layers}

    key_bases: dict[int, list[str]] = {}
    key_basis_errors_seen: dict[int, dict[str, list[float]]] = {}
    if calibration.choose_key_basis and config.bits < 16 and not heldout:
        # Nothing to choose on: channel-wise keys are safest unrotated (a dense rotation can mix slowly-varying
        # channels with fast ones); token-wise keys keep the calibrated rotation, as the paper does.
        if config.key_granularity == "channel":
            for layer in geometry.oscar_layers:
                h, d = key_rotations[layer].shape[:2]
                key_rotations[layer] = torch.eye(d, dtype=torch.float64).expand(h, d, d).clone()
                key_bases[layer] = ["identity"] * h
    key_clips = value_clips = key_blocks = None
    curves: dict[int, dict] = {}
    block_errors: dict[int, dict[int, torch.Tensor]] = {}
    key_bits = calibration.allocation_key_bits(config, geometry.head_dim)
    choices = calibration.key_block_choices(config)
    allocate = (config.key_granularity == "channel" and calibration.key_block_allocation == "fitted"
                and len(choices) > 1
                and (len(geometry.oscar_layers) * geometry.num_key_value_heads >= MIN_ALLOCATION_HEADS
                     or key_bits > config.bits + 2 * config.meta_bits / config.key_block + 1e-9))
    # The wide heads first: with fitted key channels a 2-bit head stores its raw channels (sorted by width, below),
    # so its key blocks and clips are weighed in that basis, and only the wide heads keep a chosen basis.
    head_bits = retrieval = None
    wide_budget = calibration.wide_budget(geometry.head_dim)
    if calibration.wide_heads == "retrieval" and config.wide_layout:
        retrieval = retrieval_scores(model, tokenizer)
        head_bits = allocate_wide_heads(retrieval, config, geometry.head_dim, wide_budget,
                                        key_bits=key_bits if allocate else None)
    fitted_channels = calibration.key_channel_bits == "fitted" and config.wide_channel_layout and bool(heldout)
    if heldout and config.bits < 16:
        key_clips, value_clips = {}, {}
        layers = geometry.oscar_layers
        if progress:  # about half of the calibration time
            from tqdm.auto import tqdm

            layers = tqdm(layers, desc="OSCAR clip fitting", unit="layer")
        for layer in layers:
            q, k, v, scale = collector.record[layer]
            dev = q.device
            if key_means is not None:  # fit on what the centered cache quantizes
                k = k - key_means[layer].to(dev, k.dtype)[:, None, :]
            bits = head_bits[layer] if head_bits else None  # every key and value error weighs what each head stores
            wide = [b == WIDE_BITS for b in bits] if bits else []
            if calibration.choose_key_basis and (not fitted_channels or any(wide)):
                candidates = key_basis_candidates(key_rotations[layer])
                errors = key_basis_errors(q, k, v, {n: r.to(dev) for n, r in candidates.items()}, scale, config, bits)
                key_rotations[layer], key_bases[layer] = choose_key_basis(candidates, errors, targets.per_head)
                key_basis_errors_seen[layer] = {n: e.tolist() for n, e in errors.items()}
            if fitted_channels:
                key_rotations[layer], key_bases[layer] = _raw_channels_unless_wide(
                    key_rotations[layer], key_bases.get(layer), wide)
            if allocate:
                block_errors[layer] = key_block_errors(q, k, v, key_rotations[layer].to(dev), scale, config, choices,
                                                       bits)
            errs = clip_errors(
                q, k, v, key_rotations[layer].to(dev), value_rotations[layer].to(dev), scale, config,
                calibration.clip_grid, bits
            )
            curves[layer] = errs
            key_clips[layer], value_clips[layer] = best_ratio(errs["key"]), best_ratio(errs["value"])
        if allocate:
            key_blocks = allocate_key_blocks(block_errors, config, choices, key_bits)
    key_wide_channels = channel_widths = None
    if fitted_channels:
        # (without held-out tokens there is nothing to weigh the channels on: 2 bits in each, like the key blocks)
        key_wide_channels, channel_widths = {}, {}
        for layer in geometry.oscar_layers:
            q, k, _, _ = collector.record[layer]
            if key_means is not None:
                k = k - key_means[layer].to(k.device, k.dtype)[:, None, :]
            heads = k.shape[0]
            blocks = key_blocks[layer] if key_blocks is not None else (config.key_block,) * heads
            counts, perms, widths = allocate_wide_channels(q, k, blocks, config,
                                                           None if head_bits is None else head_bits[layer])
            key_wide_channels[layer], channel_widths[layer] = counts, widths
            key_rotations[layer] = torch.stack([r if p is None else p for r, p in
                                                zip(key_rotations[layer].double().cpu(), perms)])
            names = key_bases.setdefault(layer, ["calibrated"] * heads)
            for h, p in enumerate(perms):
                if p is not None:
                    names[h] = "channels sorted by width"
    seconds = time.perf_counter() - start

    import transformers

    metadata = {
        "calibration": {
            "data": data_info,
            "tokens": used_tokens,
            "sequences": len(sequences),
            "sequence_length": seq_len,
            "heldout_tokens": sum(len(s) for s in heldout),
            "seconds": round(seconds, 2),
            "device": str(_input_device(model)),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        },
        "method": targets.describe(),
        "key_basis": {
            "chosen": {str(layer): names for layer, names in key_bases.items()},
            "errors": {str(layer): errs for layer, errs in key_basis_errors_seen.items()},
            "objective": "relative attention-output error on held-out tokens, keys quantized as stored (each head at "
                         "its history bits), values exact",
        } if key_bases else None,
        "key_block_allocation": {
            "objective": "least summed relative attention-output error on held-out tokens (keys quantized in the "
                         "stored basis at each head's history bits, values exact) within budget_key_bits",
            "choices": list(choices),
            "budget_key_bits": round(key_bits, 4),
            "average_key_bits": round(sum(config.bits + 2 * config.meta_bits / b for bl in key_blocks.values() for b in bl)
                                      / sum(len(bl) for bl in key_blocks.values()), 4),
            "errors": {str(layer): {str(b): e.tolist() for b, e in errs.items()} for layer, errs in block_errors.items()},
        } if key_blocks else None,
        "key_channel_bits": {
            "objective": "least held-out expected logit error sum_c E[q_c^2] * D_c(b_c) (raw post-RoPE channels, "
                         "GQA-pooled query energy, key error over the head's blocks) at an average of bits per channel",
            "widths": list(CHANNEL_WIDTHS),
            "channel_widths": {str(layer): w.tolist() for layer, w in channel_widths.items()},
        } if channel_widths is not None else None,
        "wide_heads": {
            "objective": "highest retrieval score (attention from a repeated random-token sequence to the token after "
                         "each token's first occurrence) within budget_history_bits",
            "budget_history_bits": wide_budget,
            "bits": WIDE_BITS,
            "scores": {str(layer): [round(float(x), 5) for x in sc] for layer, sc in retrieval.items()},
        } if retrieval is not None else None,
        "clip_fit": {
            "objective": "relative attention-output error on held-out tokens, keys/values outside sink+window "
                         "quantized as stored, each head at its history bits (one ratio per layer, wide heads unclipped)",
            "grid": list(calibration.clip_grid),
            "errors": {str(layer): {w: {str(r): e for r, e in c.items()} for w, c in errs.items()} for layer, errs in curves.items()},
        },
        "oscar_config": config.to_dict(),
        "calibration_config": calibration.to_dict(),
        FINGERPRINT_KEY: weight_fingerprint(model),
        "versions": {
            "oscar_hf": _version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }
    layout = {name: getattr(config, name) for name in LAYOUT_FIELDS if name != "key_block_allocation"}
    rotations = OscarRotations(
        geometry_dict_for(model.config),
        {k: v.float() for k, v in key_rotations.items()},
        {k: v.float() for k, v in value_rotations.items()},
        {k: v.float() for k, v in key_eigs.items()},
        {k: v.float() for k, v in value_eigs.items()},
        key_clips,
        value_clips,
        metadata=metadata,
        key_means=None if key_means is None else {k: v.float() for k, v in key_means.items()},
        layout=layout | {"key_block_allocation": calibration.key_block_allocation},
        key_blocks=key_blocks,
        head_bits=head_bits,
        key_wide_channels=key_wide_channels,
    )
    rotations.report = CalibrationReport(seconds, used_tokens, metadata["calibration"]["heldout_tokens"], key_clips, value_clips, curves,
                                         key_blocks, head_bits, key_wide_channels)
    rotations.statistics = collector.layers
    return rotations


def _version() -> str:
    from . import __version__

    return __version__
