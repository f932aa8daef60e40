"""Every benchmark runs as `python benchmarks/X.py` with the repository on PYTHONPATH too (as on a GPU machine set up
by hand): run as a script, benchmarks/ is sys.path[0], and none of its scripts may stand in for a module that hilo's
models import (tests/test_module_names.py checks the names themselves)."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# In one interpreter (torch imported once): each script's top level run as `python benchmarks/X.py` would run it,
# from a clean sys.path and with the repository's own modules forgotten, then the imports hilo's models make.
PROBE = """
import importlib, runpy, sys
scripts, repo = sys.argv[1:], {repo!r}
base = [repo + "/benchmarks", *sys.path[1:]]
failed = []
for script in scripts:
    sys.path[:] = base
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None) or ""
        if file.startswith(repo + "/") and not file.startswith(sys.prefix):  # the repo's, not a venv inside it
            del sys.modules[name]
    try:
        runpy.run_path(script, run_name="probe")
        importlib.import_module("models")
        assert sys.modules["hilo_kernels"].__file__.startswith(repo + "/hilo_kernels/")
        stand_ins = [name for name, mod in sys.modules.items()
                     if (getattr(mod, "__file__", None) or "").startswith(repo + "/benchmarks/")
                     and not name.startswith("benchmarks.")]
        assert not stand_ins, stand_ins
    except Exception as err:
        failed.append(f"{{script}}: {{type(err).__name__}}: {{err}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_script_imports_the_repo_packages_with_the_repo_on_pythonpath():
    # the scripts that locate the repository as they load, to import from it (the others import nothing of hilo's)
    scripts = sorted(str(p) for p in (REPO / "benchmarks").glob("*.py")
                     if re.search(r"^REPO\w* = Path\(__file__\)", p.read_text(), re.MULTILINE))
    assert len(scripts) >= 10, scripts
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO)), *scripts], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
