from pathlib import Path

import pytest

from medley.errors import MedleyInputError
from medley.spec.cluster_load import load_cluster, parse_cluster_arg

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_demo_cluster():
    cluster = load_cluster(EXAMPLES / "demo.toml")
    assert cluster.num_devices == 12
    assert [d.id for d in cluster.devices] == list(range(12))
    assert [d.type.name for d in cluster.devices[::4]] == ["A100-80GB", "V100-32GB", "T4-16GB"]
    assert cluster.node_pair_link("a100", "t4") == (25 / 8, 50.0)
    assert cluster.devices[0].price_per_hour == pytest.approx(3.67)


def test_cloud_cluster_and_large_cluster():
    cloud = load_cluster(EXAMPLES / "cloud-a100-v100.toml")
    assert cloud.devices_by_type().keys() == {"A100-40GB", "V100-16GB"}
    assert cloud.node_pair_link(cloud.nodes[0].name, cloud.nodes[1].name)[0] == 2.4
    large = load_cluster(EXAMPLES / "large-1024.toml")
    assert large.num_devices == 1024 and len(large.device_types()) == 4
    assert [t.name for t in large.tiers] == ["rack", "zone", "region"]
    assert large.node_pair_link("h100-r0-0", "h100-r0-7") == (25.0, 5.0)
    assert large.node_pair_link("h100-r0-0", "a100-r3-0") == (12.5, 10.0)
    assert large.node_pair_link("h100-r0-0", "l4-r0-0") == (25 / 8, 1000.0)


def test_overrides_rename_types_and_set_prices(tmp_path: Path):
    cluster = load_cluster(
        write(
            tmp_path,
            """
[[nodes]]
name = "n0"
device = "A100-80GB"
count = 2
tflops = 250
price_per_hour = 2.0
[[nodes.devices]]
local_rank = 1
memory_gb = 70
price_per_hour = 1.5
""",
        )
    )
    first, second = cluster.devices
    assert first.type.name == "A100-80GB@n0" and first.type.peak_tflops_half == 250
    assert second.type.name == "A100-80GB@n0/1" and second.type.memory_gb == 70
    assert second.type.peak_tflops_half == 250 and second.price_per_hour == 1.5


def test_tiers_groups_patterns_and_pair_overrides(tmp_path: Path):
    cluster = load_cluster(
        write(
            tmp_path,
            """
[[nodes]]
name = "a"
device = "A100-40GB"
count = 8
repeat = 2
[[nodes]]
name = "b"
device = "V100-16GB"
count = 8
[[tiers]]
name = "rack"
bandwidth_gbps = 25
groups = { r0 = ["a-*"], r1 = ["b"] }
[[tiers]]
name = "dc"
bandwidth_gbit = 100
latency_us = 30
pairs = [{ between = ["r0", "r1"], bandwidth_gbps = 1.0, latency_us = 500 }]
""",
        )
    )
    assert [n.name for n in cluster.nodes] == ["a-0", "a-1", "b"]
    assert cluster.node("a-1").groups == ("r0", "dc")
    assert cluster.node_pair_link("a-0", "a-1") == (25.0, 25.0)
    assert cluster.node_pair_link("a-0", "b") == (1.0, 500.0)


def test_short_forms():
    one = parse_cluster_arg("8xA100-80GB")
    assert one.num_devices == 8 and len(one.nodes) == 1 and one.tiers == []
    two = parse_cluster_arg("4xA100-80GB+4xv100-32gb")
    assert [n.name for n in two.nodes] == ["node0", "node1"]
    assert two.devices[4].type.name == "V100-32GB"
    with pytest.raises(MedleyInputError, match="COUNTxTYPE"):
        parse_cluster_arg("eight A100s")


BAD_CASES = {
    "unknown device": ('[[nodes]]\nname="n"\ndevice="A100-80G"\ncount=4\n', r"nodes\[0\]\.device.*A100-80GB"),
    "zero count": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=0\n',
        r"nodes\[0\]\.count.*greater than 0; fix: use a number > 0",
    ),
    "negative memory": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\nmemory_gb=-4\n',
        r"nodes\[0\]\.memory_gb",
    ),
    "negative bandwidth": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n'
        '[[tiers]]\nname="e"\nbandwidth_gbps=-1\n',
        r"tiers\[0\]\.bandwidth_gbps",
    ),
    "duplicate node": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n'
        '[[tiers]]\nname="e"\nbandwidth_gbps=1\n',
        r"nodes\[1\]\.name.*duplicate node name 'n'",
    ),
    "missing group member": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n'
        '[[tiers]]\nname="e"\nbandwidth_gbps=1\ngroups={g=["n","x"]}\n',
        r"tiers\[0\]\.groups\.g.*'x' is not one of the nodes",
    ),
    "missing pair group": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n'
        '[[tiers]]\nname="e"\nbandwidth_gbps=1\npairs=[{between=["n","zz"],bandwidth_gbps=1}]\n',
        r"tiers\[0\]\.pairs\[0\]\.between.*'zz'",
    ),
    "no tiers": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n',
        r"field 'tiers'.*no network tier",
    ),
    "unjoined groups": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n'
        '[[tiers]]\nname="e"\nbandwidth_gbps=1\ngroups={g=["n"],h=["m"]}\n',
        r"outer tier",
    ),
    "malformed toml": ('[[nodes]\nname="n"\n', r"malformed TOML"),
    "typo field": ('[[nodes]]\nname="n"\ndevice="T4"\ncount=1\ncuont=2\n', r"nodes\[0\]\.cuont.*spelling"),
    "bad local rank": (
        '[[nodes]]\nname="n"\ndevice="T4"\ncount=2\n[[nodes.devices]]\nlocal_rank=2\n',
        r"devices\[0\]\.local_rank.*use 0\.\.1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_cluster_files_name_file_field_and_fix(tmp_path: Path, case: str):
    text, pattern = BAD_CASES[case]
    path = write(tmp_path, text)
    with pytest.raises(MedleyInputError, match=pattern) as info:
        load_cluster(path)
    message = str(info.value)
    assert str(path) in message
    assert "fix" in message.lower() or "did you mean" in message.lower()


def test_missing_file_is_an_input_error(tmp_path: Path):
    with pytest.raises(MedleyInputError, match="cannot read"):
        load_cluster(tmp_path / "nope.toml")


def test_nodes_carry_their_hosts(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    from medley.spec.cluster_load import load_cluster

    path = tmp_path / "c.toml"
    path.write_text('[[nodes]]\nname = "a"\ndevice = "A100-80GB"\ncount = 2\nhost = "10.0.0.1"\n'
                    '[[nodes]]\nname = "v"\ndevice = "V100-32GB"\ncount = 1\nrepeat = 2\n'
                    'hosts = ["v0", "v1"]\n'
                    '[[tiers]]\nname = "eth"\nbandwidth_gbps = 3\n')
    cluster = load_cluster(path)
    assert [(n.name, n.host) for n in cluster.nodes] == [("a", "10.0.0.1"), ("v-0", "v0"), ("v-1", "v1")]


@pytest.mark.parametrize(("node", "expected"), [
    ('repeat = 2\nhost = "h"', "give `hosts`"),
    ('repeat = 2\nhosts = ["h"]', "`hosts` has 1 entries but `repeat` is 2"),
    ('hosts = ["h x"]', "not a host name"),
])
def test_bad_hosts_are_one_line_errors(tmp_path, node: str, expected: str) -> None:  # noqa: ANN001
    from medley.spec.cluster_load import load_cluster

    path = tmp_path / "c.toml"
    path.write_text(f'[[nodes]]\nname = "a"\ndevice = "A100-80GB"\ncount = 2\n{node}\n')
    with pytest.raises(MedleyInputError, match=expected) as err:
        load_cluster(path)
    assert "\n" not in str(err.value)
