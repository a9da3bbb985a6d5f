"""README.md's Python section runs as written (from the repository root)."""

import re

from conftest import ROOT


def test_readme_python_section_runs(monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(l[4:] for l in section.splitlines() if l.startswith("    "))
    assert "mosaickv.Cache(" in code and len(code.splitlines()) <= 10
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(4, 16) ") and "SideStrategy(" in out[0]
    assert out[1] == "96"
