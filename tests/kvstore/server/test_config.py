import pytest

from kvstore.server.config import ServerConfig, load_config, parse_duration, parse_size

pytestmark = pytest.mark.unit


def test_defaults_follow_the_design():
    config = ServerConfig()
    assert config.classes == {"agent": 3 * 86400.0, "chat": 7 * 86400.0, "handoff": 600.0, "window": 3600.0,
                              "encoder": 86400.0}
    assert config.default_class == "chat"


def test_precedence_defaults_toml_env_flags(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('capacity_bytes = "2GiB"\nsegment_bytes = "8MiB"\nport = 7000\n'
                    '[classes]\nagent = "1d"\nbatch = "12h"\nchat = 3600\n')
    config = load_config(["--config", str(toml), "--port", "7002"],
                         environ={"KVSTORE_SEGMENT_BYTES": "16MiB", "KVSTORE_PORT": "7001"})
    assert config.capacity_bytes == 2 * 2**30  # from TOML
    assert config.segment_bytes == 16 * 2**20  # env over TOML
    assert config.port == 7002  # flag over env
    assert config.classes == {"agent": 86400.0, "batch": 43200.0, "chat": 3600.0}


def test_classes_from_a_flag():
    config = load_config(["--classes", "agent=3d,chat=7d,bulk=1h", "--default-class", "bulk"], environ={})
    assert config.classes["bulk"] == 3600 and config.default_class == "bulk"


@pytest.mark.parametrize("argv, message", [
    (["--durability", "maybe"], "durability"),
    (["--low-watermark", "0.99"], "low_watermark"),
    (["--capacity-bytes", "lots"], "size"),
    (["--classes", "chat=-1"], "TTL"),
    (["--classes", "agent=1d", "--default-class", "chat"], "default_class"),
    (["--port", "70000"], "port"),
    (["--max-block-bytes", "1GiB", "--max-inflight-put-bytes", "64MiB"], "max_inflight_put_bytes"),
    (["--sweep-interval-s", "soon"], "duration"),
    (["--register-ttl-s", "0.5"], "register_ttl_s"),
    (["--exit-on-stdin-eof", "maybe"], "true or false"),
])
def test_bad_values_say_what_to_change(argv, message):
    with pytest.raises(ValueError, match=message):
        load_config(argv, environ={})


def test_the_scrub_is_on_by_default_and_its_settings_are_checked(tmp_path):
    assert ServerConfig().scrub_bytes_per_s == 32 * 2**20 and ServerConfig().scrub_pause_s == 60
    config = load_config(["--scrub-bytes-per-s", "1GiB", "--scrub-pause-s", "10m"], environ={})
    assert (config.scrub_bytes_per_s, config.scrub_pause_s) == (2**30, 600)
    assert load_config([], environ={"KVSTORE_SCRUB_BYTES_PER_S": "0"}).scrub_bytes_per_s == 0  # off
    with pytest.raises(ValueError, match="scrub_bytes_per_s"):
        ServerConfig(data_dir=tmp_path, scrub_bytes_per_s=-1)
    for pause in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scrub_pause_s"):
            ServerConfig(data_dir=tmp_path, scrub_pause_s=pause)
    with pytest.raises(ValueError, match="size"):
        load_config(["--scrub-bytes-per-s", "fast"], environ={})


@pytest.mark.parametrize("field", ["leave_drain_s", "register_ttl_s"])
def test_registration_times_are_checked_without_register(tmp_path, field):
    # Found by tests/property/test_config.py: NaN passed because these were checked only with --register.
    with pytest.raises(ValueError, match=field):
        ServerConfig(data_dir=tmp_path, **{field: float("nan")})


def test_unknown_toml_key_and_missing_file(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text("capacity = 5\n")
    with pytest.raises(ValueError, match="unknown setting 'capacity'"):
        load_config(["--config", str(toml)], environ={})
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", str(tmp_path / "nope.toml")], environ={})
    toml.write_text("capacity_bytes = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(["--config", str(toml)], environ={})


def test_parsers():
    assert parse_size("1.5KiB") == 1536 and parse_size(10) == 10 and parse_size("2 GB") == 2 * 10**9
    assert parse_duration("3d") == 259200 and parse_duration("90s") == 90 and parse_duration(5) == 5


def test_the_shipped_example_config_is_valid():
    from pathlib import Path
    example = Path(__file__).resolve().parents[3] / "deploy" / "kvstore.toml"
    config = load_config(["--config", str(example)], environ={})
    assert config.classes == {"agent": 3 * 86400.0, "chat": 7 * 86400.0, "handoff": 600.0, "window": 3600.0,
                              "encoder": 86400.0}
    assert config.data_port == 50052


@pytest.mark.parametrize(("typed", "meant"), [("true", True), ("ON", True), ("1", True), ("no", False), ("off", False)])
def test_switches_take_the_words_operators_write(typed, meant):
    assert load_config(["--exit-on-stdin-eof", typed], environ={}).exit_on_stdin_eof is meant
