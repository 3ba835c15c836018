import pytest

from fleet.platform.config import (
    ConfigError,
    apply_overrides,
    load_config,
    parse_flag,
    reset_config,
)


def test_it_uses_defaults(tmp_path):
    config = load_config({"CLOACINA_HOME": str(tmp_path)})
    assert config.default_executor == "default"
    assert config.default_max_agents == 4
    assert config.heartbeat_interval_s == 15.0
    assert config.autoscale is True


def test_it_prefers_env_over_toml_over_default(tmp_path):
    (tmp_path / "config.toml").write_text(
        '[server]\ndefault_executor = "fleet"\ndefault_max_agents = 7\n'
    )
    config = load_config({"CLOACINA_HOME": str(tmp_path), "CLOACINA_DEFAULT_MAX_AGENTS": "9"})
    assert config.default_executor == "fleet"  # from toml
    assert config.default_max_agents == 9  # env beats toml


def test_flags_beat_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOACINA_HOME", str(tmp_path))
    monkeypatch.setenv("CLOACINA_DEFAULT_EXECUTOR", "fleet")
    reset_config()
    try:
        assert apply_overrides(default_executor="default").default_executor == "default"
    finally:
        reset_config()


def test_agent_liveness_flags_beat_env_and_toml(tmp_path, monkeypatch):
    """flag > env > config.toml > default, for the two serve flags of seed 000."""
    (tmp_path / "config.toml").write_text(
        "[server]\nagent_heartbeat_interval_s = 7.0\nagent_liveness_misses = 4\n"
    )
    monkeypatch.setenv("CLOACINA_HOME", str(tmp_path))
    monkeypatch.setenv("CLOACINA_AGENT_HEARTBEAT_INTERVAL_S", "5")
    reset_config()
    try:
        assert load_config().heartbeat_interval_s == 5.0  # env over toml
        assert load_config().liveness_misses == 4  # toml over default
        config = apply_overrides(
            heartbeat_interval_s=parse_flag("heartbeat_interval_s", "2.5", "--hb"),
            liveness_misses=parse_flag("liveness_misses", "6", "--misses"),
        )
        assert (config.heartbeat_interval_s, config.liveness_misses) == (2.5, 6)
        assert config.liveness_window_s == 15.0
        # Not given: the lower layers stand.
        config = apply_overrides(
            heartbeat_interval_s=parse_flag("heartbeat_interval_s", None, "--hb")
        )
        assert config.heartbeat_interval_s == 2.5
    finally:
        reset_config()


@pytest.mark.parametrize(
    "attr,raw,flag,message",
    [
        ("heartbeat_interval_s", "soon", "--agent-heartbeat-interval-s", "must be a number"),
        ("heartbeat_interval_s", "0", "--agent-heartbeat-interval-s", "must be >= 0.05"),
        ("liveness_misses", "0", "--agent-liveness-misses", "must be >= 1, got 0"),
        ("liveness_misses", "2.5", "--agent-liveness-misses", "must be an integer"),
    ],
)
def test_bad_agent_liveness_flags_are_refused_by_their_flag_name(attr, raw, flag, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_flag(attr, raw, flag)
    assert str(caught.value).startswith(flag)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CLOACINA_AUTOSCALE": "maybe"}, "CLOACINA_AUTOSCALE must be true or false"),
        ({"CLOACINA_DEFAULT_MAX_AGENTS": "four"}, "CLOACINA_DEFAULT_MAX_AGENTS"),
        ({"CLOACINA_AGENT_LIVENESS_MISSES": "0"}, "must be >= 1"),
        ({"CLOACINA_WIRE_FORMAT": "xml"}, "json or msgpack"),
        ({"CLOACINA_DB_POOL_MAX": "-1"}, "CLOACINA_DB_POOL_MAX must be >= 0"),
        ({"CLOACINA_DB_POOL_MAX": "many"}, "CLOACINA_DB_POOL_MAX must be an integer"),
        ({"CLOACINA_MAX_REGISTERED_AGENTS": "0"}, "CLOACINA_MAX_REGISTERED_AGENTS"),
        ({"CLOACINA_MAX_REGISTERED_AGENTS": "lots"}, "must be auto or a positive integer"),
    ],
)
def test_it_rejects_bad_values_by_name(tmp_path, env, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"CLOACINA_HOME": str(tmp_path), **env})


def test_it_rejects_broken_toml(tmp_path):
    (tmp_path / "config.toml").write_text("[server\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config({"CLOACINA_HOME": str(tmp_path)})


def test_the_pool_size_comes_from_the_environment(tmp_path):
    config = load_config({"CLOACINA_HOME": str(tmp_path), "CLOACINA_DB_POOL_MAX": "12"})
    assert config.db_pool_max == 12
    assert load_config({"CLOACINA_HOME": str(tmp_path)}).db_pool_max == 0  # sized automatically


def test_the_registration_cap_is_auto_or_a_number_never_below_the_limit(tmp_path):
    auto = load_config({"CLOACINA_HOME": str(tmp_path)})
    assert auto.max_registered_agents == "auto"
    assert (auto.registered_agents_cap(4), auto.registered_agents_cap(40)) == (64, 160)
    (tmp_path / "config.toml").write_text("[server]\nmax_registered_agents = 10\n")
    fixed = load_config({"CLOACINA_HOME": str(tmp_path)})
    assert (fixed.registered_agents_cap(4), fixed.registered_agents_cap(40)) == (10, 40)
    (tmp_path / "config.toml").write_text("[server]\nmax_registered_agents = -3\n")
    with pytest.raises(ConfigError, match="CLOACINA_MAX_REGISTERED_AGENTS"):
        load_config({"CLOACINA_HOME": str(tmp_path)})
