import jax
import pytest

import unsplit


def test_mesh_over_takes_each_process_first_devices():
    mesh = unsplit.mesh_over(4, "batch")
    assert mesh.axis_names == ("batch",)
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_mesh_over_more_devices_than_a_process_has_says_the_fix():
    with pytest.raises(RuntimeError, match=r"has 8 devices; the run asked for 9.*Fix"):
        unsplit.mesh_over(9)
