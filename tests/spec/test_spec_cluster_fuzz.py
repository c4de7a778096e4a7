"""Random malformed cluster files: only MedleyInputError may come out, never another exception."""

from pathlib import Path

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medley.errors import MedleyInputError
from medley.spec.cluster_load import load_cluster

scalars = st.one_of(
    st.booleans(),
    st.integers(-5, 20),
    st.floats(-10, 1e3, allow_nan=False),
    st.sampled_from(["", "n0", "n1", "A100-80GB", "T4", "nvlink", "pcie", "zz", "n*"]),
)
names = st.sampled_from(["n0", "n1", "n2", "", "bad name", "n*"])
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["n0", "g", "name", "x"]), inner, max_size=3)
    ),
    max_leaves=6,
)
node = st.fixed_dictionaries(
    {
        "name": names,
        "device": st.sampled_from(["A100-80GB", "t4", "V100-32GB", "nope", ""]),
        "count": st.integers(-2, 4),
    },
    optional={
        "repeat": st.integers(-1, 3),
        "memory_gb": st.floats(-5, 100),
        "tflops": values,
        "link": st.fixed_dictionaries(
            {},
            optional={"kind": st.sampled_from(["nvlink", "pcie", "x"]), "bandwidth_gbps": st.floats(-1, 100)},
        ),
        "devices": st.lists(
            st.fixed_dictionaries(
                {"local_rank": st.integers(-1, 4)}, optional={"memory_gb": st.floats(-1, 100)}
            ),
            max_size=2,
        ),
        "junk": values,
    },
)
tier = st.fixed_dictionaries(
    {"name": st.sampled_from(["t", "u", ""]), "bandwidth_gbps": st.floats(-1, 100, allow_nan=False)},
    optional={
        "groups": st.dictionaries(st.sampled_from(["g", "h"]), st.lists(names, max_size=3), max_size=2),
        "pairs": st.lists(
            st.fixed_dictionaries(
                {"between": st.lists(names, min_size=0, max_size=3), "bandwidth_gbps": st.floats(-1, 10)}
            ),
            max_size=2,
        ),
        "latency_us": values,
    },
)
cluster_doc = st.fixed_dictionaries(
    {},
    optional={
        "name": values,
        "nodes": st.one_of(st.lists(node, max_size=3), values),
        "tiers": st.one_of(st.lists(tier, max_size=2), values),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=cluster_doc, garble=st.integers(-1, 200))
def test_random_cluster_files_fail_only_with_input_errors(tmp_path: Path, doc: dict, garble: int):
    text = tomli_w.dumps(doc)
    if 0 <= garble < len(text):  # cut the file mid-way: often malformed TOML
        text = text[:garble] + "[" + text[garble:]
    path = tmp_path / "c.toml"
    path.write_text(text)
    try:
        cluster = load_cluster(path)
    except MedleyInputError as err:
        assert str(path) in str(err)
    else:
        assert cluster.num_devices == len(cluster.devices) > 0
