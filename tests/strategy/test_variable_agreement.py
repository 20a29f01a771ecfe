"""Every worker holds the same variables: one description, one digest, one all-gather."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from elasticdl_strategy.elastic.state import State
from elasticdl_strategy.errors import CollectiveMismatchError
from elasticdl_strategy.strategy.variable_agreement import describe, ranks_that_differ
from tests.cluster import ThreadCluster


def test_the_description_names_path_shape_and_dtype_of_tf_and_keras_variables():
    tf_variable = tf.Variable(np.zeros((2, 3), np.float32), name="w")
    keras_variable = keras.Variable(np.zeros(4), dtype="float64", name="k")
    assert describe([tf_variable]) == "w:0:(2, 3):float32"
    assert describe([keras_variable]) == "k:(4,):float64"
    unknown_rank = tf.Variable(np.zeros(3), shape=tf.TensorShape(None), name="u")
    assert describe([unknown_rank]) == "u:0:<unknown>:float64"


def test_every_rank_names_the_ranks_whose_variables_differ_from_the_root():
    descriptions = ["a:(2,):float32", "a:(2,):float32", "a:(3,):float32"]
    with ThreadCluster(3) as cluster:
        assert cluster.run(lambda comm: ranks_that_differ(comm, descriptions[comm.rank])) == [[2]] * 3
        assert cluster.run(lambda comm: ranks_that_differ(comm, descriptions[comm.rank], root=2)) == [[0, 1]] * 3


def test_a_state_whose_variables_differ_between_ranks_is_refused_on_every_rank():
    shapes = [(2,), (3,)]
    with ThreadCluster(2) as cluster:
        outcomes = cluster.run_outcomes(
            lambda comm: State._check_same_variables(comm, [tf.Variable(np.zeros(shapes[comm.rank]), name="v")])
        )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, CollectiveMismatchError), outcome
        assert outcome.ranks == (1,) and f"rank {rank}:" in str(outcome)


@pytest.mark.parametrize("n", [1, 2])
def test_the_same_variables_pass(n):
    with ThreadCluster(n) as cluster:
        assert cluster.run(lambda comm: State._check_same_variables(comm, [tf.Variable([1.0], name="v")])) == [None] * n
