"""bench/RESULTS.md: every figure names the command that produces it (issue 29, item 28).

The rule, as checked here: a table with numbers, or a paragraph with a measured figure (a time,
a rate, a ratio, a percentage), must come after a command in its own section or in a section
that encloses it (a `### ` part inherits its `## ` section's commands). A command is a code
span or a line of a fenced block that runs a bench script (`python bench/X.py ...`), the bench
suite (`python -m pytest bench ...`) or a step of `.ci/gpu`; each one must name a script that
exists, flags that script's argparse defines, test names the bench suite has, environment
settings the bench reads. A figure nobody can regenerate fails the test instead of sitting in the
file: regenerate it with a command of the repository, or drop it.
"""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"

# a number followed by a unit of something measured
FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:(?:ms|us|ns|x)\b|µs|img/s|GB/s|TB/s|[GMT]FLOP/s|×(?!\d)|%)")
PYTEST_SHORT = {"-q", "-x", "-v", "-s", "-k", "-p", "-rfEs", "-rfE"}
# options of any script (argparse adds it)
COMMON_FLAGS = {"--help"}
# environment variables a command may set that are not the bench's own
GENERIC_ENV = {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "UTENSIL_LIB", "OMP_NUM_THREADS",
               "PYTHONPATH", "BUILD_DIR", "UT_CUDA", "UT_CUDA_ARCHS", "CUDA_VISIBLE_DEVICES"}


def _script_flags(path):
    return set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)["']""", path.read_text())) | COMMON_FLAGS


def _benchmark_flags():
    try:
        import pytest_benchmark.plugin as plugin
    except ImportError:  # without the plugin, any --benchmark-* option is taken on trust
        return None
    return set(re.findall(r"--benchmark-[\w-]+", Path(plugin.__file__).read_text()))


def _bench_env():
    src = "".join(p.read_text() for p in (ROOT / "bench").glob("*.py"))
    return set(re.findall(r"UTENSIL_BENCH_\w+", src))


def _ci_steps():
    m = re.search(r'wanted=" \$\{\*:-([^}]*)\}', (ROOT / ".ci" / "gpu").read_text())
    return set(m.group(1).split())


def _k_words():
    """What a `-k` word of a bench command may match: test names, module names, devices, the
    case ids' sides and shape ids (bench/conftest.py)."""
    words = {"cpu", "cuda", "ours", "torch", "cffi"}
    for p in (ROOT / "bench").glob("test_*.py"):
        words.add(p.stem)
        words.update(re.findall(r"^def (test_\w+)", p.read_text(), re.M))
    return words


def _k_word_ok(word, words):
    return any(word in w for w in words) or re.fullmatch(r"\d+x\d+x\d+x\d+(-k\d+s\d+)?", word)


class Checker:
    def __init__(self, root=ROOT):
        self.root = root
        self.bench_flags = _benchmark_flags()
        self.env = _bench_env()
        self.ci_steps = _ci_steps()
        self.k_words = _k_words()

    # -- one command -------------------------------------------------------------------------
    def parse(self, text):
        """(kind, argv, env) of a command, or None when the text does not run a bench."""
        try:
            toks = shlex.split(text.replace("\\\n", " "))
        except ValueError:
            return None
        env = []
        if toks[:1] == ["export"]:
            return ("env", [], [t.split("=")[0] for t in toks[1:]])
        while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", toks[0]):
            env.append(toks.pop(0).split("=")[0])
        if not toks:
            return None
        if toks[0] in ("python", "python3"):
            if toks[1:3] == ["-m", "pytest"]:
                return ("pytest", toks[3:], env)
            if len(toks) > 1 and toks[1].startswith("bench/"):
                return ("script", toks[1:], env)
            return None
        if toks[0] == "pytest" and len(toks) > 1 and toks[1].startswith("bench"):
            return ("pytest", toks[1:], env)
        if toks[0] in (".ci/gpu", "./.ci/gpu"):
            return ("ci", toks[1:], env)
        return None

    def validate(self, kind, argv, env):
        """The problems of one parsed command (empty: it can run)."""
        errs = []
        for name in env:
            if name.startswith("UTENSIL_BENCH_") and name not in self.env:
                errs.append("environment setting %s is read by no bench script" % name)
            elif not name.startswith("UTENSIL_BENCH_") and name not in GENERIC_ENV:
                errs.append("unknown environment setting %s" % name)
        if kind == "script":
            script = self.root / argv[0]
            if not script.is_file():
                return errs + ["no script %s" % argv[0]]
            flags = _script_flags(script)
            for t in argv[1:]:
                if t.startswith("--") and t.split("=")[0] not in flags:
                    errs.append("%s has no flag %s" % (argv[0], t.split("=")[0]))
        elif kind == "pytest":
            paths, i = [], 0
            while i < len(argv):
                t = argv[i]
                if t == "-k":
                    if i + 1 == len(argv):
                        errs.append("-k without an expression")
                        break
                    for w in re.findall(r"[\w.-]+", argv[i + 1]):
                        if w not in ("and", "or", "not") and not _k_word_ok(w, self.k_words):
                            errs.append("-k word %r matches no benchmark" % w)
                    i += 2
                    continue
                if t.startswith("--benchmark-"):
                    if self.bench_flags is not None and t.split("=")[0] not in self.bench_flags:
                        errs.append("pytest-benchmark has no option %s" % t.split("=")[0])
                elif t.startswith("-"):
                    if t not in PYTEST_SHORT:
                        errs.append("unexpected pytest option %s" % t)
                else:
                    paths.append(t)
                i += 1
            if not paths:
                errs.append("a pytest command without the bench path")
            for p in paths:
                if not p.startswith("bench") or not (self.root / p.split("::")[0]).exists():
                    errs.append("pytest path %s is not in bench/" % p)
        elif kind == "ci":
            for t in argv:
                if t not in self.ci_steps:
                    errs.append(".ci/gpu has no step %s" % t)
        return errs

    # -- the document ------------------------------------------------------------------------
    def blocks(self, text):
        """(line number, kind, text) per heading, fenced block, table and paragraph."""
        lines = text.split("\n")
        out, i = [], 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                j = i + 1
                while j < len(lines) and not lines[j].startswith("```"):
                    j += 1
                out.append((i + 1, "fence", "\n".join(lines[i + 1:j])))
                i = j + 1
            elif re.match(r"#{1,6} ", line):
                out.append((i + 1, "heading", line))
                i += 1
            elif not line.strip():
                i += 1
            else:
                table = line.startswith("|")
                j = i
                while (j < len(lines) and lines[j].strip() and not lines[j].startswith("```")
                       and not re.match(r"#{1,6} ", lines[j])
                       and lines[j].startswith("|") == table):
                    j += 1
                out.append((i + 1, "table" if table else "para", "\n".join(lines[i:j])))
                i = j
        return out

    def commands_in(self, kind, text):
        """The commands a block holds, as (text, parsed) pairs; flag-only code spans too."""
        if kind == "fence":
            joined = re.sub(r"\\\n\s*", " ", text)
            cands = [ln.strip() for ln in joined.split("\n")
                     if ln.strip() and not ln.strip().startswith("#")]
        elif kind == "para":
            cands = [re.sub(r"\s+", " ", s) for s in re.findall(r"`([^`]+)`", text)]
        else:
            cands = []
        out = []
        for c in cands:
            if c.startswith("--"):
                out.append((c, ("flags", c.split(), [])))
            else:
                out.append((c, self.parse(c)))
        return out

    @staticmethod
    def has_figure(kind, text):
        if kind == "table":
            rows = [r for r in text.split("\n")[2:]]  # past the header and its rule
            return any(re.search(r"\d", r) for r in rows)
        if kind == "para":
            # code spans are commands and names, not figures
            return bool(FIGURE.search(re.sub(r"`[^`]*`", "", text)))
        return False

    def check(self, text):
        """Every problem of a RESULTS.md text, as 'line N: ...' strings."""
        errs = []
        known = {}  # heading level -> whether a command was seen in that section so far
        level = 0
        last_script = None  # the script (or "pytest") of the last command: prose flags are its
        for lineno, kind, body in self.blocks(text):
            if kind == "heading":
                level = len(body) - len(body.lstrip("#"))
                known = {k: v for k, v in known.items() if k < level}
                known[level] = False
                last_script = None
                continue
            for c, parsed in self.commands_in(kind, body):
                if parsed is None:
                    continue
                ck, argv, env = parsed
                if ck == "flags":  # a flag named in prose: of the command before it
                    for t in argv:
                        name = t.split("=")[0]
                        if not name.startswith("--"):
                            continue
                        if last_script == "pytest" or name.startswith("--benchmark-"):
                            if (self.bench_flags is not None and name.startswith("--benchmark-")
                                    and name not in self.bench_flags):
                                errs.append("line %d: pytest-benchmark has no option %s"
                                            % (lineno, name))
                        elif last_script is not None:
                            if name not in _script_flags(self.root / last_script):
                                errs.append("line %d: %s has no flag %s (in `%s`)"
                                            % (lineno, last_script, name, c))
                    continue
                errs += ["line %d: `%s`: %s" % (lineno, c, e) for e in self.validate(ck, argv, env)]
                if ck == "env":
                    continue
                if ck == "script":
                    last_script = argv[0] if (self.root / argv[0]).is_file() else None
                elif ck == "pytest":
                    last_script = "pytest"
                known[level] = True
            if self.has_figure(kind, body) and not any(known.values()):
                first = body.strip().split("\n")[0][:70]
                errs.append("line %d: a figure with no command before it in its section: %r"
                            % (lineno, first))
        return errs


@pytest.fixture(scope="module")
def checker():
    return Checker()


def test_every_figure_in_results_names_an_existing_command(checker):
    errs = checker.check(RESULTS.read_text(encoding="utf-8"))
    assert not errs, "bench/RESULTS.md:\n" + "\n".join(errs)


def test_results_names_the_commands_of_its_scripts(checker):
    """The rule is not met by leaving commands out: the whole-network and per-op figures name
    the scripts that make them."""
    text = RESULTS.read_text(encoding="utf-8")
    for needed in ("bench/bench_networks.py", "-m pytest", "bench/report.py",
                   "bench/bench_overhead.py", "To regenerate on an H200"):
        assert needed in text


OK_CMD = "`python bench/bench_networks.py --size 64 --batch 8`"


@pytest.mark.parametrize("doc, expect", [
    ("## A\n\n| op | ms |\n|---|---|\n| dw | 4.03 |\n", "no command before it"),
    ("## A\n\nutensil trains at 4,000 img/s.\n", "no command before it"),
    ("## A\n\nGEMM 2048³ at 164 GFLOP/s.\n", "no command before it"),
    ("## A\n\nthe C call alone ~70 µs.\n", "no command before it"),
    # a command of another section does not count
    ("## A\n\n%s\n\n## B\n\n1.5× faster.\n" % OK_CMD, "no command before it"),
    # nor one after the figure
    ("## A\n\n1.5× faster.\n\n%s\n" % OK_CMD, "no command before it"),
    ("## A\n\n`python bench/bench_gemm.py --n 2048`: 164 GFLOP/s\n", "no script bench/bench_gemm.py"),
    ("## A\n\n`python bench/bench_networks.py --sizes 64`: 128 img/s\n", "has no flag --sizes"),
    ("## A\n\n%s then `--cache-images`: 128 img/s\n" % OK_CMD, "has no flag --cache-images"),
    ("## A\n\n`python -m pytest bench -q -k \"cpu and gemm\"`: 2.1×\n", "matches no benchmark"),
    ("## A\n\n`python -m pytest bench --benchmark-rounds=3`: 2.1×\n", "has no option"),
    ("## A\n\n`UTENSIL_BENCH_GEMM=1 python -m pytest bench`: 2.1×\n", "read by no bench script"),
    ("## A\n\n`.ci/gpu gemm`: 2.1×\n", "has no step gemm"),
    ("## A\n\n`python -m pytest bench -q` with `--benchmark-rounds=3`: 2.1×\n", "has no option"),
])
def test_checker_refuses(checker, doc, expect):
    errs = checker.check(doc)
    assert any(expect in e for e in errs), errs


@pytest.mark.parametrize("doc", [
    "## A\n\n%s:\n\n| side | img/s |\n|---|---|\n| utensil | 128 |\n" % OK_CMD,
    "## A\n\n```sh\nexport UTENSIL_BENCH_THREADS=2\nMALLOC_MMAP_MAX_=0 python -m pytest bench -q \\\n"
    "  -k \"cpu and (dw or block)\" --benchmark-json=a.json\npython bench/report.py a.json\n```\n\n"
    "### B\n\ndepthwise 2.4× torch, 39 GB/s.\n",
    "## A\n\n`.ci/gpu networks`: 88,587 img/s, 2.80x.\n",
    "## A\n\nno figures here: 3x3 and 1x1 convolutions, issue 14.\n",
])
def test_checker_accepts(checker, doc):
    assert checker.check(doc) == []
