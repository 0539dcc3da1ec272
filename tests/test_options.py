"""The option objects: a setting that cannot work fails where it is written, naming the fix."""

from __future__ import annotations

import math

import pytest

import splitft
import transports
from splitft import Codecs, Factory, Faults, Link, Schedule
from splitft.errors import ConfigError
from tests.models import mlp


def test_codecs_resolve_their_partners_and_a_string_means_the_forward_codec():
    assert Codecs.of("fp16") == Codecs("fp16")
    assert Codecs.of(None).specs == Codecs().specs == {"fwd": "identity", "bwd": "identity", "ret": "identity",
                                                         "ret_bwd": "identity"}
    specs = Codecs("c3sl:r=4", bwd="fixpoint:bits=8", seed=3).specs
    assert specs["fwd"].startswith("c3sl") and specs["bwd"].startswith("fixpoint") and specs["ret"] == specs["fwd"]
    with pytest.raises(ConfigError, match="codecs must be a spec"):
        Codecs.of(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad, match", [
    (dict(fwd="zip"), "valid names"),
    (dict(fwd=None), "codec fwd must be a spec"),
    (dict(bwd=4), "codec bwd must be a spec"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"),
])
def test_codecs_refuse_what_cannot_be_coded(bad, match):
    with pytest.raises(ConfigError, match=match):
        Codecs(**bad)


def test_a_link_is_one_target_and_its_keys_come_in_pairs_for_an_address_only():
    listener = transports.InprocListener()
    try:
        assert Link.of("tcp://127.0.0.1:5555").reconnects and Link(listener.connect).reconnects
        connection = listener.connect()
        assert not Link.of(connection).reconnects
        connection.close()
        assert Link("tcp://h:1", emulate="100mbit,20ms").emulate == transports.LinkSpec.coerce("100mbit,20ms")
        with pytest.raises(ConfigError, match="needs both cloud_key"):
            Link("tcp://h:1", cloud_key="keys/cloud.key")
        with pytest.raises(ConfigError, match="encrypt a link the edge opens to an address"):
            Link(listener.connect, cloud_key="keys/cloud.key", key="keys/edge.key_secret")
        with pytest.raises(ConfigError, match="connect= takes the cloud's address"):
            Link(None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            Link("tcp://h:1", emulate="fast please")
    finally:
        listener.close()


@pytest.mark.parametrize("bad", [dict(timeout=0), dict(timeout=-1), dict(heartbeat=-0.1),
                                 dict(reconnect_timeout=math.inf), dict(timeout="60"), dict(heartbeat=True)])
def test_faults_are_finite_seconds(bad):
    with pytest.raises(ConfigError, match="seconds"):
        Faults(**bad)


def test_faults_keep_floats():
    faults = Faults(timeout=5, heartbeat=0)
    assert faults == Faults(5.0, 60.0, 0.0) and isinstance(faults.timeout, float)


@pytest.mark.parametrize("bad, match", [(dict(micro_batches=0), "positive integer"),
                                        (dict(micro_batches=2.0), "positive integer"),
                                        (dict(micro_batches=True), "positive integer"),
                                        (dict(eager_backward="yes"), "True or False")])
def test_schedule_refuses_what_cannot_be_scheduled(bad, match):
    with pytest.raises(ConfigError, match=match):
        Schedule(**bad)


@pytest.mark.parametrize("bad, match", [(dict(name="splitft.app.models.digits_cnn"), "package.module:function"),
                                        (dict(name=":fn"), "package.module:function"),
                                        (dict(name="a:b", weights="pull"), "'push' or 'factory'"),
                                        (dict(name="a:b", kwargs={1: 2}), "string keys"),
                                        (dict(name="a:b", check_cut="no"), "True or False")])
def test_factory_refuses_what_the_cloud_could_not_build(bad, match):
    with pytest.raises(ConfigError, match=match):
        Factory(**bad)


def test_factory_copies_its_kwargs():
    given = {"seed": 1}
    factory = Factory.of(Factory("a:b", kwargs=given))
    given["seed"] = 2
    assert factory.kwargs == {"seed": 1} and Factory.of("a:b") == Factory("a:b")


def test_split_refuses_a_wrong_option_object_before_connecting():
    with pytest.raises(ConfigError, match=r"schedule= takes a splitft.Schedule"):
        splitft.split(mlp(), 2, factory="tests.models:mlp", connect="tcp://127.0.0.1:1",
                      schedule=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"faults= takes a splitft.Faults"):
        splitft.split(mlp(), 2, factory="tests.models:mlp", connect="tcp://127.0.0.1:1",
                      faults=Schedule())  # type: ignore[arg-type]
