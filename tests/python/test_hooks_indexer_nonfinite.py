"""A non-finite production indexer score becomes an event and the run's non-finite onset:
the HF adapter on a tiny GLM-5 whose indexer is handed a NaN query at one token, in-process."""

import json
import math
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import torch
from conftest import binary


def test_a_nan_in_the_production_indexer_scores_is_an_event_and_the_onset(tmp_path: Path) -> None:
    import tiny_models
    from shadowtrace_hooks import session, startup

    # k = 16 over 40 tokens: the poisoned query (token 20) selects among 21 keys, a sparse row.
    model, ids = tiny_models.glm(index_topk=16), tiny_models.prompt(40)

    def poison(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Only the indexer's copy of q_resid: attention itself stays finite.
        args, kwargs = list(args), dict(kwargs)
        q_resid = (kwargs["q_resid"] if "q_resid" in kwargs else args[1]).clone()
        q_resid[:, 20] = math.nan
        if "q_resid" in kwargs:
            kwargs["q_resid"] = q_resid
        else:
            args[1] = q_resid
        return tuple(args), kwargs

    model.model.layers[1].self_attn.indexer.register_forward_pre_hook(poison, with_kwargs=True)
    assert startup.activate({"SHADOWTRACE": "1", "SHADOWTRACE_DIR": str(tmp_path)}) is not None
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        session.stop()
    assert bool(torch.isfinite(logits).all()), "the NaN stayed in the indexer"

    (run,) = tmp_path.iterdir()
    events = pq.read_table(run / "events").to_pylist()
    indexer = [e for e in events if e["site"] == "indexer"]
    assert [(e["layer"], e["path"], e["kind"], e["token"], e["channel"], e["count"]) for e in indexer] == [
        (1, "prod", "nan", 20, 0, 21)
    ]
    topk = pq.read_table(run / "topk").to_pylist()
    (row,) = [r for r in topk if r["layer"] == 1 and r["token"] == 20]
    assert row["visible"] > row["k"], "a sparse row"
    assert math.isnan(row["prod_kth_score"]), "its k-th score NaN, not the null of a dense row"

    out = subprocess.run(
        [binary("shadowtrace"), "analyze", run, "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    (analysed,) = json.loads(out.stdout)["runs"]
    onset = analysed["onset"]
    assert (onset["layer"], onset["site"], onset["token"], onset["kind"]) == (1, "indexer", 20, "nan")
