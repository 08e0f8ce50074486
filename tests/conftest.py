"""Every test sees 8 simulated CPU devices; nothing tries to open a TPU or GPU; every
process of a run (xdist workers, CLI subprocesses, launch-local workers, notebook kernels)
shares one persistent compilation cache, so a program compiled once is not compiled again.
Tests that count compiles count cache hits too (helpers.counting_compiles)."""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
# One cache per run: the first process (pytest itself, before it starts its workers) makes it,
# and every process started later inherits the variables.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-test-compiles-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Only programs that took a second or more to compile are written: writing every small one
# cost more than reading it back saves (tests/test_parallel.py: 54 s with all, 45 s so, 43 s
# with no cache; CLI- and subprocess-heavy files the same either way).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The suite's CPU programs are tiny and run once or twice: LLVM's optimization of them costs
# more than it saves (tests/test_parallel.py: 71 s -> 38 s). Only the CPU backend's code
# generation changes: the HLO passes (SPMD partitioning, collectives, memory analysis) are the
# same, and libtpu's TPU compiles report the same memory and collectives with it set.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
from packaging.version import Version  # noqa: E402

# Compiling for TPU topologies on this CPU host needs libtpu (the `tpu` extra, which CI
# installs): tests marked `tpu` skip where it is missing, and fail there when
# JAXPAR_REQUIRE_LIBTPU is set, so a CI without it cannot pass by skipping them.
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _skip_tpu_tests_without_libtpu(items):
  if HAS_LIBTPU:
    return
  if os.environ.get("JAXPAR_REQUIRE_LIBTPU"):
    raise pytest.UsageError("JAXPAR_REQUIRE_LIBTPU is set but libtpu is not installed: pip install -e '.[tpu]'")
  skip = pytest.mark.skip(reason="libtpu not installed (pip install -e '.[tpu]')")
  for item in items:
    if "tpu" in item.keywords:
      item.add_marker(skip)


# Scheduling for `pytest -n 2 --dist loadgroup`: each file is one group (its module fixtures
# are built once, on one worker), except heavy tests that share nothing expensive (every test
# of SPLIT_FILES, and OWN_GROUP), which are groups of their own that either worker may take;
# the heaviest groups start first, so the last to start is a short one. Seconds per file:
# docs/testing.md (benchmarks/test_durations.py).
SPLIT_FILES = {"test_compile_shipped.py"}
OWN_GROUP = {"test_llama3_8b_at_131k_tokens_fits_v5p_with_ring_attention",
             "test_offloaded_activations_live_in_host_memory_not_hbm"}
HEAVY_FIRST = ["test_compile_shipped.py", "test_long_context_train.py", "test_compile.py", "test_grpo_learns.py",
               "test_pipeline.py",
               "test_engine.py", "test_multiprocess.py", "test_quantization_quality.py", "test_moe_parallel.py",
               "test_train.py", "test_lora.py", "test_parallel.py", "test_checkpoint.py"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
  _skip_tpu_tests_without_libtpu(items)
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  for item in items:
    name = item.path.name
    alone = name in SPLIT_FILES or item.originalname in OWN_GROUP
    item.add_marker(pytest.mark.xdist_group(item.nodeid if alone else name))
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within


def pytest_configure(config):
  # pytest-xdist 3.8 puts a test's group into its node id, which pytest 9.2 no longer reads:
  # the groups would be ignored and each file's module fixtures built on both workers.
  if config.getoption("dist", "no") == "loadgroup" and Version(pytest.__version__) >= Version("9.2"):
    raise pytest.UsageError(f"--dist loadgroup does not group tests with pytest {pytest.__version__}: "
                            "pip install 'pytest>=8,<9.2'")


@pytest.fixture(scope="module", autouse=True)
def _optimized_when_marked(request):
  """Modules marked `optimized` run long programs (training runs that learn): there XLA's
  optimizations pay for themselves, in this process and the ones it starts."""
  if request.node.get_closest_marker("optimized") is None:
    yield
    return
  before = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"], jax.config.read("jax_disable_most_optimizations")
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = before[0]
  jax.config.update("jax_disable_most_optimizations", before[1])


@pytest.fixture(scope="session", autouse=True)
def _a_working_folder_per_worker(tmp_path_factory):
  """Runs that keep the config's default run_dir (`runs/<name>`) land in the worker's own
  folder, never in the checkout, and never in a folder another worker trains in."""
  os.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _a_working_folder_per_test(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # and no test resumes what an earlier test left in `runs/`
