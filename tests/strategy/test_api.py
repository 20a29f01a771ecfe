"""The tf.distribute surface of AllReduceStrategy on 2 worker processes, eagerly and in tf.function."""

import json
import sys

import pytest

from tests.launch import run_job, worker_script

pytestmark = pytest.mark.slow

N = 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    job = run_job(N, [sys.executable, worker_script("strategy_api.py"), str(out)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(N)]


@pytest.mark.parametrize("label", ["eager", "graph"])
def test_reduce_and_replica_context_collectives(reports, label):
    # replica r returns [r+1, r+1]
    total = sum(r + 1 for r in range(N))
    for report in reports:
        assert report[f"{label}_sum"] == [total, total]
        assert report[f"{label}_mean"] == [total / N, total / N]
        assert report[f"{label}_sum_axis0"] == 2 * total
        assert report[f"{label}_mean_axis0"] == total / N  # mean over all 2N elements
        assert report[f"{label}_all_reduce"] == [[total] * 3, [sum(range(N))] * 2]
        assert report[f"{label}_all_gather"] == [10 * r + i for r in range(N) for i in range(r + 1)]
        assert report[f"{label}_merge_call"] == sum(range(N))


def test_experimental_run_v2_runs_like_run_and_warns_once(reports):
    total = sum(r + 1 for r in range(N))
    for report in reports:
        assert report["run_v2_sum"] == [total, total]
        assert len(report["run_v2_warnings"]) == 1 and "strategy.run" in report["run_v2_warnings"][0]


def test_tf1_entry_points_work_or_name_their_tf2_replacement(reports):
    for report in reports:
        r = report["rank"]
        assert report["numpy_dataset"] == ([[0, 1, 2], [5, 6, 7]] if r == 0 else [[3, 4], [8, 9]])
        tf1 = report["tf1"]
        assert tf1["make_dataset_iterator"][0] == "UsageError"
        assert "experimental_distribute_dataset" in tf1["make_dataset_iterator"][1]
        assert "distribute_datasets_from_function" in tf1["make_input_fn_iterator"][1]
        assert tf1["graph_variable"][0] == "UsageError" and "tf.function" in tf1["graph_variable"][1]


def test_inputs_are_iterated_without_multi_device_iterators(reports):
    for report in reports:
        assert report["iterator_kinds"] == ["OwnedIterator"] * 4
        assert report["distributed_with_options"] == report["distributed"]


def test_gather_and_values_from_function(reports):
    for report in reports:
        assert report["gather"] == [r for r in range(N) for _ in range(r + 1)]
        assert report["values_from_function"] == 10 * report["rank"]


def test_datasets_are_split_between_workers(reports):
    for report in reports:
        r = report["rank"]
        assert report["input_context"] == [N, r, N]
        assert report["from_function"] == [[r, r + 2], [r + 4, r + 6]]
    # Global batches of 5 rows are split 3 / 2, like np.array_split.
    assert reports[0]["distributed"] == [[0, 1, 2], [5, 6, 7]]
    assert reports[1]["distributed"] == [[3, 4], [8, 9]]


def test_variables_start_from_rank_0_and_broadcast_on_demand(reports):
    for report in reports:
        assert report["variable_at_creation"] == [0.0, 0.0, 0.0]
        assert report["variable_after_broadcast"] == [float(N - 1 + 5)] * 3


def test_checkpoint_is_written_once_and_restores_on_every_worker(reports):
    assert [r["should_checkpoint"] for r in reports] == [r["rank"] == 0 for r in reports]
    for report in reports:
        assert report["restored_equal"]
        assert report["optimizer_iterations"] == 3  # fit for 2 steps, then 1 with ModelCheckpoint


def test_model_save_and_model_checkpoint_write_on_rank_0_only(reports):
    for report in reports:
        r = report["rank"]
        assert report["writes_files"] == (r == 0)
        expected = [f"ckpt_by_rank{r}.weights.h5", f"saved_by_rank{r}.keras"] if r == 0 else []
        assert report["wrote"] == expected


def test_variables_created_in_another_order_raise_mismatch_on_every_rank(tmp_path):
    job = run_job(N, [sys.executable, worker_script("strategy_variable_mismatch.py"), str(tmp_path)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    for r in range(N):
        outcome = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert outcome["error"] == "CollectiveMismatchError", outcome
        assert outcome["ranks"] == [N - 1]
        assert "same variables in the same order" in outcome["message"]


def test_training_outside_the_strategy_is_an_error_not_silent_local_training(tmp_path):
    job = run_job(N, [sys.executable, worker_script("strategy_misuse.py"), str(tmp_path)], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    for r in range(N):
        outcomes = json.loads((tmp_path / f"rank{r}.json").read_text())
        for case, says in [
            ("model_outside_scope", "created outside AllReduceStrategy.scope()"),  # compile made its optimizer
            ("model_outside_scope_compiled_inside", "model was built outside AllReduceStrategy.scope()"),
            ("apply_gradients_outside_run", "apply_gradients ran outside strategy.run"),
            ("optimizer_outside_scope", "created outside AllReduceStrategy.scope()"),
        ]:
            assert outcomes[case] is not None and outcomes[case].startswith("UsageError"), (case, outcomes[case])
            assert says in outcomes[case], (case, outcomes[case])
