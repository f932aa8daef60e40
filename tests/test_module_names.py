"""No top-level module name of the repository is one that an installed distribution or the standard library also
provides: two modules of one name shadow each other, whichever comes first on sys.path being imported for both (a
package of ours named `kernels` broke transformers, which imports Hugging Face's `kernels`, and was broken by it).
The names: the packages, the entry points, the folders imported as namespace packages (tests, benchmarks) and
benchmarks/' scripts, which run with benchmarks/ as sys.path[0]."""
import importlib.metadata
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repository_names() -> set[str]:
    names = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    names |= {p.stem for p in REPO.glob("*.py")} | {"tests", "benchmarks"}
    return names | {p.stem for p in (REPO / "benchmarks").glob("*.py")}


def installed_names() -> dict[str, str]:
    """top-level module name -> who provides it (a distribution, or the standard library)."""
    found = {name: "the standard library" for name in (*sys.stdlib_module_names, *sys.builtin_module_names)}
    for dist in importlib.metadata.distributions():
        owner = dist.metadata["Name"]
        if owner is None or owner.lower() == "hilo":
            continue
        tops = set((dist.read_text("top_level.txt") or "").split())
        for file in dist.files or ():
            head = file.parts[0]
            if len(file.parts) == 1 and head.endswith(".py"):
                tops.add(head[:-3])
            elif len(file.parts) > 1 and head.isidentifier():  # a package folder (not *.dist-info, not ../bin)
                tops.add(head)
        found.update({name: owner for name in tops if name not in found})
    return found


def test_the_repository_names_no_module_that_something_installed_provides():
    names = repository_names()
    assert {"hilo_kernels", "models", "data", "training", "eval_suites", "train", "operators"} <= names, names
    installed = installed_names()
    clashes = sorted(f"{name} (also provided by {installed[name]})" for name in names if name in installed)
    assert not clashes, f"rename these modules of the repository: {', '.join(clashes)}"


def test_an_installed_package_is_seen():
    # the check above only means something if it sees what is installed: transformers' own top-level package
    assert installed_names().get("transformers") == "transformers"
