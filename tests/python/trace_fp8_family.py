"""GLM-5.3-Flash (`glm5_next`) converted to transformers' fine-grained FP8 (tiny_fp8.convert) and
traced with the local shadow, under transformers 5.24 (installed apart, first on PYTHONPATH):
the FP8 kernel emulated from its definition, the test's own dequantized fp32 model fed each
layer's production input. Saves, per layer and site, the per-token relative L2 error the
reference gives and the one the hooks recorded, and the run's manifest.

usage: trace_fp8_family.py LENGTH RUNS_DIR OUT.pt
"""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import pyarrow.parquet as pq
import tiny_family
import tiny_fp8
from shadowtrace_hooks import session, startup

SITES = ("attn_out", "mlp_out")


def main() -> None:
    length, runs, out = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    # Expert halves of whole 128-row blocks, as real checkpoints have (FP8Experts needs them).
    bf16 = tiny_family.glm5_next(moe_intermediate_size=128)
    model, _ = tiny_fp8.convert(copy.deepcopy(bf16))
    ref = tiny_fp8.dequantized_fp32(bf16, model)
    ids = tiny_family.prompt(length)
    layers = model.model.language_model.layers
    prod_in, prod_site, handles = {}, {}, []

    def keep(store, key):
        def hook(m, a, output):
            store[key] = (output[0] if isinstance(output, tuple) else output).detach().float().clone()

        return hook

    for i, layer in enumerate(layers):

        def pre(m, args, kwargs, i=i):
            prod_in[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles += [getattr(layer, n).register_forward_hook(keep(prod_site, (i, s))) for s, n in
                    (("attn_out", "self_attn"), ("mlp_out", "mlp"))]  # fmt: skip
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(runs), "SHADOWTRACE_MODE": "local"})
    try:
        with tiny_fp8.kernel_emulated(), torch.no_grad():
            model(ids)
    finally:
        session.stop()
    for h in handles:
        h.remove()
    want, handles = {}, []
    for i, layer in enumerate(ref.model.language_model.layers):

        def swap(m, args, kwargs, i=i):
            x = prod_in[i].float()
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        handles.append(layer.register_forward_pre_hook(swap, with_kwargs=True))
        handles += [getattr(layer, n).register_forward_hook(keep(want, (i, s))) for s, n in
                    (("attn_out", "self_attn"), ("mlp_out", "mlp"))]  # fmt: skip
    with torch.no_grad():
        ref(ids)
    (manifest_path,) = runs.glob("*/manifest.json")
    rows = pq.read_table(manifest_path.parent / "hidden").to_pylist()
    result = {"manifest": json.loads(manifest_path.read_text()), "sites": {}}
    for (i, site), p in prod_site.items():
        s = want[i, site][0].reshape(length, -1)
        p = p[0].reshape(length, -1)
        expected = ((p - s).norm(dim=-1) / s.norm(dim=-1)).tolist()
        got = sorted((r for r in rows if (r["layer"], r["site"], r["shadow_mode"]) == (i, site, "local")),
                     key=lambda r: r["token"])  # fmt: skip
        result["sites"][f"{i}.{site}"] = {"expected": expected, "recorded": [r["rel_l2_err"] for r in got],
                                          "tokens": [r["token"] for r in got]}  # fmt: skip
    torch.save(result, out)


if __name__ == "__main__":
    main()
