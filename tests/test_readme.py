"""The README's Python examples run as written."""

import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_examples_run():
    """As one script run with ``python``: what starts worker processes stands under the
    ``__main__`` guard a script needs."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    scope: dict = {"__name__": "__main__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in blocks:
            exec(compile(block, str(README), "exec"), scope)
    assert scope["plan"].world_size == 1024


def test_the_command_lines_name_files_that_exist_and_the_constraint_example_runs():
    """Every file a ``chronotope`` line of the README names (path/to/... and FILE
    placeholders aside) is in the repository, and the search constraint example runs."""
    import shlex

    from chronotope.cli import main

    root = README.parent
    lines = [line.split("  #")[0].strip() for block in
             re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    named = {word.split(":")[0] for line in lines if line.startswith("chronotope ")
             for word in shlex.split(line) if re.fullmatch(r"[\w./-]+\.py(:\w+)?", word)}
    named = {n for n in named if not n.startswith(("path/to", "FILE"))}
    assert named and all((root / n).is_file() for n in named), named
    constrained = next(x for x in lines if "--constrain" in x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(shlex.split(constrained)[1:] + ["--no-simulate"]) == 0


def test_the_docs_python_examples_run(tmp_path, monkeypatch):
    """Each page of docs/ as one script, in a scratch folder (they write their pictures)."""
    pages = sorted((README.parent / "docs").rglob("*.md"))
    monkeypatch.chdir(tmp_path)
    ran = 0
    for page in pages:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        scope: dict = {"__name__": "__main__"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for block in blocks:
                exec(compile(block, str(page), "exec"), scope)
                ran += 1
    assert ran
