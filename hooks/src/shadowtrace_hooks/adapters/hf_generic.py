"""Any HF transformers decoder: per-layer hidden states, the shadow, the logits and the
non-finite onset of a decoder-only model without an indexer (hybrid linear-attention and
MoE models included: `qwen3_5_moe`'s Gated DeltaNet layers and their recurrent state).

Installed on every `transformers.models.<name>.modeling_<name>` module no model-specific
adapter claims: its classes with `generate` (causal LMs, and multimodal models generating
text) are wrapped as the DSA adapter's are (`hf.patch`). The structure is found, not
declared: the decoder is the module holding the `ModuleList` of `num_hidden_layers` layers
(the shallowest), the sites are each layer's token mixer (`attn_out`: `self_attn`,
`linear_attn`, `mixer`, ...) and feed-forward block (`mlp_out`), the logits' shadow runs the
decoder's final norm and the LM head. Everything else is `hf._Tracer`'s: runs per request,
steps, the local and free shadows re-running each layer in the shadow precision, the
logits, the events.

A model it cannot trace or shadow is refused at its first traced call, with one line that
says why, counted in the process (`models_refused`, `process.models_refused` in later
runs); the model runs untraced:

- not a decoder-only model (an encoder-decoder);
- no decoder layers it can find;
- layers with an indexer (DSA): its selections need a model-specific adapter.

A model it can trace but not shadow is traced for production alone, the reason in each
run (`settings.shadow_refused`, counted `shadow_refused`) and one line:

- weights the shadow can neither upcast nor dequantize (integer or FP8 codes outside
  transformers' fine-grained FP8 modules, another quantization method: shadowtrace_hooks.dequant;
  FP8Linear and FP8Experts are dequantized and shadowed);
- a shadow precision below production's (a bf16 shadow of an fp32 model);
- `SHADOWTRACE_SHADOW_SCOPE=indexer`, which shadows the indexer alone: these models have none.
"""

import inspect
from typing import Any

import torch

from shadowtrace_hooks.adapters import hf
from shadowtrace_hooks.adapters.layout import Layout, Symbol
from shadowtrace_hooks.session import Session
from shadowtrace_hooks.shadow import dtype_name
from shadowtrace_hooks.shadow import hooks_suspended as shadow_hooks_suspended

NAME = hf.NAME
LAYOUTS: tuple[Layout, ...] = ()  # the structure is found at the first call, not declared

MIXERS = ("self_attn", "linear_attn", "mixer", "attention", "self_attention", "attn", "temporal_block")
FEED_FORWARDS = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
_PRECISION = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


class Refused(Exception):
    """A model the generic adapter does not trace; the message says why."""


def install(module: Any) -> None:
    """Wraps the module's generating classes (defined there, with `forward` and
    `generate`) so every instance traces itself when called."""
    from transformers.generation import GenerationMixin

    version = hf._version()
    for name, cls in list(vars(module).items()):
        if not (
            isinstance(cls, type) and issubclass(cls, GenerationMixin) and cls.__module__ == module.__name__
        ):
            continue
        if getattr(cls, "_shadowtrace_patched", False) or "forward" not in vars(cls):
            continue
        params = list(inspect.signature(cls.forward).parameters)
        cache = next((p for p in ("cache", "past_key_values") if p in params), None)
        if "input_ids" not in params or cache is None:
            continue  # not a text decoder's forward
        symbol = Symbol(module.__name__, f"{name}.forward", ("self", "input_ids"), leading=True)
        layout = Layout(name=f"{cache}=", source=f"structure found at run time on transformers {version}; "
                        f"checked on transformers {CHECKED}", symbols=(symbol,))  # fmt: skip
        hf.patch(cls, layout, GenericTracer)
        module._shadowtrace_layout = layout


# The newest release the generic adapter was run on in the tests (qwen3_5_moe): a later one
# is marked untested in every run (layout.run_settings).
CHECKED = "5.24.0"


class GenericTracer(hf._Tracer):
    """hf._Tracer on a structure found by looking, with the refusals above."""

    # Model-specific subclasses that trace their indexers (hf_glm5_next, hf_deepseek_v4).
    TRACES_INDEXERS = False
    # Their indexers are traced by their own `_indexer`, which reads no captured top-k input.
    CAPTURES_TOPK_SCORES = False
    GRAFTS_REFUSED = (
        "grafts are implemented for glm_moe_dsa and deepseek_v32 (the hf adapter), not for the "
        "models the generic adapter traces"
    )

    @classmethod
    def attach(cls, model: torch.nn.Module, sess: Session, rope: Any, inputs: hf._Inputs) -> Any:
        tracer = model.__dict__.get("_shadowtrace")
        # An earlier session's tracer (one stopped since) is inert: this session attaches its own.
        if (tracer is not None and tracer.sess is sess) or model.__dict__.get("_shadowtrace_refused"):
            return tracer
        try:
            return super().attach(model, sess, rope, inputs)
        except Refused as e:
            model.__dict__["_shadowtrace_refused"] = str(e)
            sess.count("models_refused")
            sess.warn_once(
                f"{NAME}:refused:{type(model).__name__}", f"{NAME} {hf._version()}: {e}; not traced"
            )
            return None

    def __init__(self, model: torch.nn.Module, sess: Session, rope: Any, inputs: hf._Inputs) -> None:
        config = model.config
        kind = type(model).__name__
        if getattr(config, "is_encoder_decoder", False):
            raise Refused(
                f"{kind} is an encoder-decoder model: the generic adapter traces decoder-only models"
            )
        self._found = _find_decoder(model)
        if self._found is None:
            layers = config.get_text_config().num_hidden_layers
            raise Refused(f"{kind}: no module holds its {layers} decoder layers as a ModuleList")
        for i, layer in enumerate([] if self.TRACES_INDEXERS else self._found[1]):
            for name, _ in layer.named_modules():
                if name.rsplit(".", 1)[-1] == "indexer":
                    raise Refused(
                        f"{kind}: layer {i} has an indexer ({name}): "
                        "its selections need a model-specific adapter"
                    )
        # hf._Tracer's own: asks `_why_no_shadow` below, refuses in every run it opens
        super().__init__(model, sess, rope, inputs)

    def _why_no_shadow(self, kind: str) -> str | None:
        if self.settings.precision is None:
            return None
        if self.settings.scope == "indexer":
            return (
                f"{kind}: SHADOWTRACE_SHADOW_SCOPE=indexer shadows an indexer alone, and this model has "
                f"none; production is traced alone"
            )
        _, layers = self._found
        shadow = self.settings.shadow_dtype
        quantized = super()._why_no_shadow(kind)  # a weight it cannot dequantize
        if quantized is not None:
            return quantized
        if not any(isinstance(getattr(self.inner, n, None), torch.nn.Module) for n in FINAL_NORMS):
            return (
                f"{kind}: no final norm found after the decoder layers: the logits' shadow cannot be computed"
            )
        text = self.config.get_text_config()
        for field in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(text, field, None) not in (None, 1, 1.0):
                return (
                    f"{kind}: its logits are post-processed ({field}), which the logits' shadow does not do"
                )
        prod = next(layers.parameters()).dtype
        if _PRECISION.get(shadow, 0) < _PRECISION.get(prod, 0):
            return (
                f"{kind}: production runs in {dtype_name(prod)}, above the shadow's "
                f"{self.settings.precision}; production is traced alone"
            )
        return self._rotary_refuses_text_positions(kind)

    def _rotary_refuses_text_positions(self, kind: str) -> str | None:
        """The shadow re-run builds cos/sin from the step's text positions [batch, tokens]
        (`hf._Tracer._shadow_pe`); a rotary module that takes only its own layout of them
        (transformers 5.17's Qwen3.5 wants multimodal [3, batch, tokens]) would raise in every
        layer's shadow, each counted and disabled. Asked once, up front, on one position."""
        rotary = self.rotary
        # A model adapter that builds its own cos/sin (DeepSeek-V4's per-layer-type rotary)
        # is not asked: its `_shadow_pe` is not the one probed here.
        if rotary is None or type(self)._shadow_pe is not GenericTracer._shadow_pe:
            return None
        buffer = next(rotary.buffers(), None)
        device = buffer.device if buffer is not None else torch.device("cpu")
        try:
            with torch.no_grad(), shadow_hooks_suspended(rotary):
                rotary.forward(
                    torch.empty(0, device=device), torch.zeros(1, 1, dtype=torch.long, device=device)
                )
        except Exception as e:
            return (
                f"{kind}: its rotary embedding ({type(rotary).__name__}) takes no text positions "
                f"[batch, tokens] on transformers {hf._version()} ({type(e).__name__}: {e}): the shadow "
                "re-run cannot build its cos/sin; production is traced alone"
            )
        return None

    def _decoder(self) -> torch.nn.Module:
        return self._found[0]

    def _sites(self, layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
        out = {}
        for site, names in (("attn_out", MIXERS), ("mlp_out", FEED_FORWARDS)):
            block = next(
                (getattr(layer, n) for n in names if isinstance(getattr(layer, n, None), torch.nn.Module)),
                None,
            )
            if block is not None:
                out[site] = block
        return out

    def _indexer_module(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        return None

    def _head(self) -> list[torch.nn.Module]:
        norm = next(
            (
                getattr(self.inner, n)
                for n in FINAL_NORMS
                if isinstance(getattr(self.inner, n, None), torch.nn.Module)
            ),
            None,
        )
        head = self.model.get_output_embeddings()
        return [m for m in (norm, head) if m is not None]

    def _shadow_kwargs(self, step: hf._Step) -> dict[str, Any]:
        kwargs = super()._shadow_kwargs(step)
        if "position_embeddings" not in step.layer_kwargs:
            kwargs.pop("position_embeddings")
        return kwargs

    def _shadow_pe(self, step: hf._Step) -> Any:
        if self.rotary is None:  # a model without a shared rotary module: production's, as given
            return step.layer_kwargs.get("position_embeddings")
        return super()._shadow_pe(step)

    def _record_sentinels(self, layer: int, step: hf._Step) -> None:
        """The KV sentinel watch on full-attention layers only: a sliding window's slots are
        not positions, and recurrent states have no slots."""
        cache = step.layer_kwargs.get(self.inputs.cache_name) or step.layer_kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        if layers is None or layer >= len(layers):
            return
        entry = layers[layer]
        if getattr(entry, "sliding_window", None) or not isinstance(
            getattr(entry, "keys", None), torch.Tensor
        ):
            return
        super()._record_sentinels(layer, step)


def _find_decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    """The module holding the text decoder's layers (a ModuleList named `layers` or `h` of
    num_hidden_layers distinct modules; the shallowest such) and the list."""
    want = model.config.get_text_config().num_hidden_layers
    best: tuple[int, torch.nn.Module, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name not in ("layers", "h") or not isinstance(child, torch.nn.ModuleList):
                continue
            if len(child) != want or len({id(m) for m in child}) != want:
                continue
            depth = name.count(".") + (1 if name else 0)
            if best is None or depth < best[0]:
                best = (depth, module, child)
    return None if best is None else (best[1], best[2])
