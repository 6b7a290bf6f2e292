import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

# PrefetchPipeline's default ("auto") runs prefetch inline where no core is free, as on a
# 2-core CI machine; the suite keeps exercising the background threads (the GPU path's
# mode) unless a test asks for inline or auto itself (tests/test_modules.py).
os.environ.setdefault("HIERMEM_BACKGROUND", "threads")


#: Long tests, left out by `pytest -m "not slow"` (the full suite and CI still run them):
#: file -> test names (None: the whole file).  Tests may also carry @pytest.mark.slow.
SLOW = {
    "test_concurrency.py": None,  # soaks: threads scraping, flushing, checkpointing
    "test_fuzz.py": None,  # hypothesis state machines and trace corruptions
    "test_sharding_exec.py": None,  # gloo process groups of 2 and 4
    "test_sharding_bench.py": None,  # runs the sharding benchmark scripts
    "test_core_parity.py": None,  # every kernel again with NUMBA_DISABLE_JIT=1
    "test_tune.py": {"test_readme_tuning_commands_run"},  # imports the shared traces and tunes
    "test_sim.py": {"test_movielens_lru_sim_equals_cachetools_and_libcachesim",
                    "test_cli_entry_point_runs"},  # 2.2 s: the CLI in a subprocess
    # durations below: the lead's full run of 2026-12-05 16:00 UTC, 2 shared cores
    "test_adaptive_prefetch.py": {"test_a_prefetch_that_costs_more_than_it_hides_is_turned_off",  # 27 s: timed trials
                                  "test_switching_modes_trains_exactly"},  # 14 s: two 90-step trainings
    "test_sharding_nodes.py": None,  # 19 s: two torchrun launches
    "test_readonly.py": {"test_load_test_quick_no_torn_or_stale_rows",  # 13 s: bench_readers --quick, processes
                         "test_reader_follows_the_map_as_the_writer_grows_it",  # 4.2 s (2): processes
                         "test_cli_export_while_a_process_trains",  # 3.5 s: processes
                         "test_readers_in_other_processes_see_the_last_flush_while_training_goes_on"},  # 2.1 s
    "test_modules.py": {"test_checkpoint_survives_sigkill_and_resume_reproduces_losses",  # 13 s: kills a trainer
                        "test_prefetch_thread_stress",  # 3.5 s: a stress run
                        "test_state_dict_round_trip_and_restore_in_a_fresh_process",  # 2.1 s: a subprocess
                        # below: a `-m "not slow"` run of 2026-12-06 22:50 UTC (-n 2, another job beside it)
                        "test_pins_exceeding_the_device_tier_degrade_depth_and_stay_exact",  # 16 s
                        "test_mean_mode_and_per_sample_weights_equal_plain",  # 15 s
                        "test_inline_prefetch_equals_background_threads"},  # 11 s
    "test_bench_scripts.py": {"test_paired_runs_both_configurations_on_the_same_batches"},  # 10 s
    # below: a `-m "not slow"` run of 2026-12-05 16:18 UTC (2 shared cores), summed over parameters
    "test_writemap.py": {"test_training_through_a_growing_map_is_exact_and_the_map_is_allocated",  # 57 s (4)
                         "test_reopening_with_a_smaller_map_never_shrinks_the_file",  # 6.5 s
                         "test_a_full_disk_during_map_growth_changes_nothing_and_recovers"},  # 4.4 s
    "test_write_behind.py": {"test_map_growth_from_the_writer_thread"},  # 18 s (2)
    "test_dataplane.py": {"test_kernels_compiled_equal_interpreted"},  # 16 s (4): NUMBA_DISABLE_JIT parity
    "test_faults.py": {"test_kill_at_any_rename_of_restore_leaves_a_store_that_opens"},  # 4.7 s: kills
    "test_metrics.py": {"test_scrapes_do_not_change_or_block_training",  # 4.5 s: a scraping soak
                        "test_cli_serve_and_demo_metrics_port",  # 2.5 s: CLI processes
                        "test_real_prometheus_evaluates_every_dashboard_expression"},  # 19 s: a real Prometheus
    "test_sharding_nccl.py": None,  # 4.5 + 1.9 s: a gloo group; the NCCL script without CUDA
    "test_durability.py": {"test_flush_then_sigkill_keeps_flushed_values",  # 3.8 s (2): kills
                           "test_truncated_data_mdb_past_meta_pages_is_refused"},  # 3.3 s
    "test_sharding_planner.py": {"test_plan_scale_script_runs_small"},  # 2.6 s: runs the script
    "test_install.py": {"test_an_installed_torch_is_kept"},  # 2.9 s: install.sh in a subprocess
    "test_gpu_check.py": {"test_gpu_check_without_cuda_says_so_and_exits_0"},  # 2.6 s: gpu_check.sh in a subprocess
    "test_demo.py": {"test_port_in_use_is_one_line"},  # 2.0 s: the CLI in a subprocess
    "test_torture.py": {"test_kills_lose_and_tear_nothing",  # 115 s (4): kills a trainer, once per mode
                        "test_checker_reports_lost_and_torn_rows"},  # 1.9 s
}


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        names = SLOW.get(item.path.name, ())
        if names is None or item.originalname in names:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from hypothesis import Phase, settings  # noqa: E402

# HYPOTHESIS_PROFILE=noshrink reports the first failing example at once (mutation checks)
settings.register_profile("noshrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "default"))


@contextmanager
def mounted_tmpfs(where: Path, size: str):
    """A tmpfs of ``size`` (mount(8) syntax) mounted at the new directory ``where``."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (container without CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs: a disk that fills."""
    with mounted_tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


def pytest_configure(config):
    """With test workers (pytest-xdist), compile the kernels once here, before the workers
    start, instead of in every worker at once on a fresh checkout (a stamp check when the
    cache is warm)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    if config.option.collectonly:
        return
    from hiermem.store import warm
    from hiermem.store.hierarchical import HierarchicalStore

    warm.ensure_compiled(store_class=HierarchicalStore)
