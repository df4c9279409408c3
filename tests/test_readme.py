"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest


def _run_example(heading: str = "") -> dict:
    """Runs the README's first Python example after `heading` (the first of all for
    ""); returns its namespace."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split(heading, 1)[1] if heading else text
    example = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    return namespace


def test_readme_python_example_runs():
    namespace = _run_example()
    assert namespace["diff_src"].shape == (8, 56, 56, 32)
    assert namespace["diff_weights"].shape == (3, 3, 32, 64)


def test_readme_pytorch_example_runs(capsys):
    pytest.importorskip("torch")
    namespace = _run_example("## PyTorch: `convgrad.torch`")
    printed = capsys.readouterr().out
    assert "3 module(s) converted, 0 left alone" in printed
    assert "torch.Size([4, 8, 32, 32]) True" in printed
    assert namespace["dx"].shape == (4, 16, 32, 32)
    assert namespace["dw"].shape == (32, 4, 3, 3)
    assert all(p.grad is not None for p in namespace["model"].parameters())


def test_readme_jax_example_runs(capsys):
    pytest.importorskip("jax")
    _run_example("## JAX: `convgrad.jax`")
    printed = capsys.readouterr().out
    assert "(3, 3, 64, 64)" in printed
    assert "convgrad ConvTransposeBackwardData (NXC, XIO weights)" in printed


DOCS = ["README.md", "benchmarks/results/README.md", *(f"docs/{p.name}" for p in
        sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md")))]


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("name", DOCS)
def test_links_between_the_docs_resolve(name):
    """Every relative link of the README and the docs names a file that exists, and an
    anchor a heading of that file."""
    root = Path(__file__).resolve().parent.parent
    path = root / name
    text = path.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or name != "README.md"
    for link in links:
        if "://" in link:
            continue
        target, _, anchor = link.partition("#")
        linked = (path.parent / target).resolve() if target else path
        assert linked.exists(), f"{name}: {link} names no file"
        if anchor:
            assert anchor in _anchors(linked.read_text()), f"{name}: {link} names no heading"


def test_readme_commands_parse():
    """Every `convgrad` command line of the README's shell blocks is one the command's
    parser accepts (synopses with [options] and elisions are left out)."""
    import shlex

    from convgrad.cli import build_parser

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    commands = [part.strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S)
                for line in block.splitlines() for part in line.split("#")[0].split("&&")]
    commands = [c.split("convgrad ", 1)[1] for c in commands
                if "convgrad " in c and not c.startswith(("pip", "python", "make"))
                and "[" not in c and "..." not in c]
    assert len(commands) >= 5
    for command in commands:
        try:
            build_parser().parse_args(shlex.split(command))
        except SystemExit as error:
            raise AssertionError(f"README: convgrad {command} does not parse") from error
