"""A Ray address nobody answers at is refused at once, naming the key (``ray.init`` would retry for
minutes); addresses Ray resolves itself are left to it."""

import socket

import pytest

from posttrain.grpo.engines.ray_pool import check_reachable

pytestmark = pytest.mark.core


def test_an_unreachable_ray_address_is_refused_naming_the_key():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectionError, match=r"engine.ray_address / RAY_ADDRESS '127.0.0.1:\d+': no Ray cluster"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    check_reachable(f"127.0.0.1:{listener.getsockname()[1]}")  # something answers: no error
    listener.close()
    check_reachable("auto")
    check_reachable("ray://head:10001")
