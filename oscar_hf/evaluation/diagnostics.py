"""Per-layer diagnostics: how far each layer's attention drifts from BF16 when the KV cache is quantized.

The paper's error-propagation figure, and `oscar-hf report` ("how well does quantization hold on my data?").

Protocol (`layer_errors`): a token sequence is split into a context (the first `context` tokens, prefilled into a
fresh cache of the method) and a scored chunk (the next `chunk` tokens, fed through that cache, so its queries attend
to the stored, quantized context). The scored chunk runs with a recording attention function that computes the
attention explicitly and keeps, per layer: the attention probabilities, the attention-block output (after o_proj),
and the keys/values it was given. The same is done with a BF16 `DynamicCache`. Per layer:

- `attention_kl`: KL(p_bf16 ‖ p_method) of the attention probabilities, mean over heads and scored queries (nats);
- `attention_output_error`: ‖a − â‖² / ‖a‖² of the attention-block output after o_proj;
- `hidden_error`: ‖h − ĥ‖² / ‖h‖² of the layer's output hidden state (errors propagated from earlier layers included);
- `key_error`, `value_error`: ‖K − K̂‖² / ‖K‖² over the context tokens, as the cache hands them back (pure storage
  error: the context's own keys/values are exact BF16 in every method, see `niah.py`);
- `key_mean_share`, `value_mean_share` (BF16 reference): the share of the keys'/values' energy in their per-channel
  mean over the context, i.e. how much of every token is the same offset vector.
Errors propagate: layer l of the method sees the hidden states the method produced at layers < l, as in use.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers import AttentionInterface, DynamicCache

from ..metrics import cache_kwarg
from ..models import model_geometry, text_config
from .methods import Method

DIAGNOSTICS_NAME = "oscar_diagnostics"
_recording = threading.local()


def _diagnostic_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Explicit attention (float32) that records probabilities, outputs and keys/values per layer.

    query `[B, Hq, T, d]`, key/value `[B, H, S, d]` (past as the cache returns it, then the current chunk)."""
    b, hq, t, d = query.shape
    h, s = key.shape[1], key.shape[2]
    g = hq // h
    scale = scaling if scaling is not None else d**-0.5
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if attention_mask is None:
        i = torch.arange(t, device=query.device).unsqueeze(1) + (s - t)
        visible = torch.arange(s, device=query.device).unsqueeze(0) <= i
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, Hq, T, d]
    out_t = out.transpose(1, 2).contiguous().to(query.dtype)
    recorder = getattr(_recording, "layers", None)
    if recorder is not None and getattr(module, "layer_idx", None) is not None:
        block = module.o_proj(out_t.reshape(b, t, hq * d)).float()
        recorder[module.layer_idx] = {"probs": probs[0], "block": block[0], "keys": key[0].float(), "values": value[0].float()}
    return out_t, None


def register() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DIAGNOSTICS_NAME, _diagnostic_attention)
    AttentionMaskInterface.register(DIAGNOSTICS_NAME, sdpa_mask)


@contextlib.contextmanager
def recording(model):
    """Runs `model` with the recording attention; yields the dict that fills with per-layer records."""
    register()
    previous = text_config(model.config)._attn_implementation
    model.set_attn_implementation(DIAGNOSTICS_NAME)
    _recording.layers = {}
    try:
        yield _recording.layers
    finally:
        _recording.layers = None
        model.set_attn_implementation(previous)


@torch.no_grad()
def _run(model, ids: torch.Tensor, cache, context: int, chunk: int) -> dict:
    kwarg = cache_kwarg(model)
    device = model.get_input_embeddings().weight.device
    ids = ids.to(device)
    model(input_ids=ids[:, :context], use_cache=True, logits_to_keep=1, **{kwarg: cache})
    with recording(model) as layers:
        out = model(input_ids=ids[:, context : context + chunk], use_cache=True, output_hidden_states=True, **{kwarg: cache})
        records = dict(layers)
    return {"layers": records, "hidden": [h[0].float() for h in out.hidden_states[1:]], "logits": out.logits[0].float()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).square().sum() / a.square().sum().clamp(min=1e-30))


def _mean_share(x: torch.Tensor) -> float:
    """Share of the energy of `x` `[H, n, d]` in its per-channel mean over tokens: Σ_h ‖μ_h‖²·n / Σ ‖x‖².

    Near 1: every token carries the same large per-channel offset (e.g. a k/v projection bias, or a learned k-norm
    scale); token-wise quantization spends its few levels on it, per-channel quantization (KIVI keys) absorbs it."""
    mean = x.mean(dim=1, keepdim=True)
    return float(mean.square().sum() * x.shape[1] / x.square().sum().clamp(min=1e-30))


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean KL(p ‖ q) over all rows of probability tensors `[..., S]`."""
    tiny = torch.finfo(torch.float32).tiny
    kl = (p * (torch.log(p.clamp(min=tiny)) - torch.log(q.clamp(min=tiny)))).sum(-1)
    return float(kl.mean())


def compare(reference: dict, run: dict, context: int) -> dict:
    """Per-layer errors of `run` against `reference` (outputs of `_run`)."""
    layers = []
    for idx in sorted(reference["layers"]):
        ref, got = reference["layers"][idx], run["layers"][idx]
        past = ref["keys"].shape[1] - ref["probs"].shape[1]  # keys = stored past, then the scored chunk
        layers.append({
            "layer": idx,
            "attention_kl": _kl(ref["probs"], got["probs"]),
            "attention_output_error": _relative(ref["block"], got["block"]),
            "hidden_error": _relative(reference["hidden"][idx], run["hidden"][idx]),
            "key_error": _relative(ref["keys"][:, :past], got["keys"][:, :past]) if past else 0.0,
            "value_error": _relative(ref["values"][:, :past], got["values"][:, :past]) if past else 0.0,
            "key_mean_share": _mean_share(ref["keys"][:, :past]) if past else 0.0,
            "value_mean_share": _mean_share(ref["values"][:, :past]) if past else 0.0,
        })
    p = torch.softmax(reference["logits"], -1)
    q = torch.softmax(run["logits"], -1)
    return {"layers": layers, "logits_kl": _kl(p, q),
            "mean_attention_kl": sum(x["attention_kl"] for x in layers) / len(layers),
            "mean_attention_output_error": sum(x["attention_output_error"] for x in layers) / len(layers),
            "final_hidden_error": layers[-1]["hidden_error"]}


def layer_errors(model, sequences: list[torch.Tensor], methods: dict[str, Method], rotations: dict,
                 context: int = 1536, chunk: int = 128) -> dict[str, dict]:
    """Per-layer errors of each method against BF16, averaged over `sequences` (each `[n]`, n >= context + chunk).

    Returns `{method: {"layers": [...], "logits_kl", "mean_attention_kl", ...}}`.
    """
    geometry = model_geometry(model.config)
    results: dict[str, list[dict]] = {name: [] for name in methods}
    for ids in sequences:
        if ids.shape[-1] < context + chunk:
            raise ValueError(f"a diagnostics sequence needs context + chunk = {context + chunk} tokens, got {ids.shape[-1]}")
        ids = ids.reshape(1, -1)
        reference = _run(model, ids, DynamicCache(config=model.config), context, chunk)
        for name, method in methods.items():
            run = _run(model, ids, method.make_cache(model, rotations.get(name)), context, chunk)
            results[name].append(compare(reference, run, context))
    averaged = {}
    for name, runs in results.items():
        layers = []
        for i, first in enumerate(runs[0]["layers"]):
            row = {"layer": first["layer"], "sliding": geometry.plan[first["layer"]] == "sliding"}
            for key in ("attention_kl", "attention_output_error", "hidden_error", "key_error", "value_error",
                        "key_mean_share", "value_mean_share"):
                row[key] = sum(r["layers"][i][key] for r in runs) / len(runs)
            layers.append(row)
        summary = {k: sum(r[k] for r in runs) / len(runs) for k in ("logits_kl", "mean_attention_kl", "mean_attention_output_error", "final_hidden_error")}
        averaged[name] = {"layers": layers, **summary}
    return averaged


def format_table(results: dict[str, dict]) -> str:
    """A per-layer text table: attention KL / attention-output error per method."""
    names = list(results)
    head = "layer | " + " | ".join(f"{n} KL / out err" for n in names)
    lines = [head, "-" * len(head)]
    n_layers = len(results[names[0]]["layers"])
    for i in range(n_layers):
        row = results[names[0]]["layers"][i]
        cells = [f"{results[n]['layers'][i]['attention_kl']:.4f} / {results[n]['layers'][i]['attention_output_error']:.4f}" for n in names]
        lines.append(f"{row['layer']:5d}{'s' if row['sliding'] else ' '}| " + " | ".join(cells))
    lines.append("mean  | " + " | ".join(f"{results[n]['mean_attention_kl']:.4f} / {results[n]['mean_attention_output_error']:.4f}" for n in names))
    lines.append("logits KL | " + " | ".join(f"{results[n]['logits_kl']:.4f}" for n in names))
    return "\n".join(lines)


def plot(results: dict[str, dict], path, title: str = "") -> None:
    """Per-layer attention KL, attention-output error and hidden-state error per method (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("attention_kl", "attention KL(p_bf16 ‖ p_q)"), ("attention_output_error", "attention output rel. error"),
            ("hidden_error", "hidden state rel. error"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, keys):
        for name, res in results.items():
            xs = [row["layer"] for row in res["layers"]]
            ys = [max(row[key], 1e-9) for row in res["layers"]]
            ax.plot(xs, ys, marker=".", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
