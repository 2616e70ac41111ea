"""The layers stay apart: the training path (what runs inside a user's train()) never imports a tool."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hfstream"
TOOLS = [PACKAGE / "cli", PACKAGE / "plan", PACKAGE / "testing"]       # what a person runs beside training
TOOL_MODULES = ("hfstream.cli", "hfstream.plan", "hfstream.testing", "dev")   # dev/: outside the package


def _is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOL_MODULES)


def _training_path_files():
    return [p for p in PACKAGE.rglob("*.py") if not any(t in p.parents for t in TOOLS) and p.name != "__main__.py"]


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).parts[:-1])


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module a file imports, at the top or inside a function, resolved to absolute names."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_training_path_file_imports_a_tool_even_lazily():
    offenders = {str(p.relative_to(REPO)): sorted(m for m in _imported_modules(p.read_text(), _package_of(p))
                                                  if _is_tool(m))
                 for p in _training_path_files()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_checker_sees_relative_and_lazy_imports():
    # The check above must be able to fail: lazy relative and absolute imports of a tool are seen.
    source = "def f():\n    from ..cli import plot\n    from ..cli.bench import link\n    import hfstream.cli.data\n"
    seen = _imported_modules(source, "hfstream.gradsync")
    assert {"hfstream.cli", "hfstream.cli.plot", "hfstream.cli.bench.link", "hfstream.cli.data"} <= seen


def test_constructing_the_public_objects_loads_no_tool_module(tmp_path):
    script = f"""
import sys, torch
from hfstream import GradSync, StreamPrefetcher
model = torch.nn.Linear(4, 4)
with GradSync(model, bucket_mb=1.0):
    pass
assert [b.shape for b in StreamPrefetcher([torch.zeros(2)], depth=1)] == [torch.Size([2])]
assert "datasets" not in sys.modules, "GradSync/StreamPrefetcher pulled in datasets"

from hfstream import StreamTrainer, StreamTrainingArguments
from transformers import GPT2Config, GPT2LMHeadModel
lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
ds = [{{"input_ids": torch.arange(8), "labels": torch.arange(8)}} for _ in range(4)]
args = StreamTrainingArguments(output_dir={str(tmp_path)!r}, max_steps=1, per_device_train_batch_size=2,
                               report_to="none", use_cpu=True)
trainer = StreamTrainer(model=lm, args=args, train_dataset=ds)
trainer.train()
tools = sorted(m for m in sys.modules if m.startswith(("hfstream.cli", "hfstream.plan", "hfstream.testing", "dev.")))
assert not tools, tools
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
