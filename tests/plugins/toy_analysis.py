"""An analysis as a plugin module (config ``plugins: [toy_analysis]`` and a key ``analysis.toy_norms``;
tests/test_plugins.py): the RMS of every parameter tensor of a checkpoint. Torch-free at import."""
from stem.analysis.workflow import analysis


@analysis("toy_norms", only_for=lambda kind: kind["tables"])   # by default: models with STEM tables
def toy_norms(ckpt_dir, spec: dict) -> dict:
    from safetensors.torch import load_file   # torch: only in the analysis job
    weights = load_file(f"{ckpt_dir}/model.safetensors")
    top = spec.get("top", 5)
    rms = {name: float(w.float().square().mean().sqrt()) for name, w in weights.items()}
    return {"rms": dict(sorted(rms.items(), key=lambda kv: -kv[1])[:top])}
