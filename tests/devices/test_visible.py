import pytest

from joules.devices.visible import MigDevice, VisibleTarget, resolve_visible_devices, visible_targets
from joules.errors import DeviceNotFoundError

U0 = "GPU-8f3a1c2e-0000-4000-8000-000000000000"
U1 = "GPU-8f3b77aa-1111-4000-8000-111111111111"
U2 = "GPU-c0ffee00-2222-4000-8000-222222222222"
M20 = "MIG-1a2b3c4d-aaaa-5000-9000-000000000001"
M21 = "MIG-1a2b9999-bbbb-5000-9000-000000000002"

DEVICES = [
    (0, U0, []),
    (1, U1, []),
    (2, U2, [MigDevice(M20, 1, 0), MigDevice(M21, 2, 0)]),
]


def phys(value, devices=DEVICES, **kw):
    return [t.physical_index for t in visible_targets(value, devices, **kw)]


def test_unset_shows_every_gpu_in_nvml_order():
    shuffled = [DEVICES[2], DEVICES[0], DEVICES[1]]
    assert visible_targets(None, shuffled) == [VisibleTarget(0), VisibleTarget(1), VisibleTarget(2)]


def test_empty_shows_no_gpu():
    vis = resolve_visible_devices("", DEVICES)
    assert vis.targets == ()
    assert "empty" in vis.note
    assert phys("   ") == []


def test_integer_ordinals_keep_their_order():
    assert phys("0,2") == [0, 2]
    assert phys("2,0") == [2, 0]
    assert phys(" 1 , 0") == [1, 0]
    assert phys("+1") == [1]


def test_parsing_stops_at_first_invalid_entry():
    vis = resolve_visible_devices("0,1,-1,2", DEVICES)
    assert [t.physical_index for t in vis.targets] == [0, 1]
    assert vis.ignored == ("-1", "2")
    assert "entry 2" in vis.note
    assert phys("0,7,1") == [0]  # out of range (3 GPUs)
    assert phys("1,abc,0") == [1]
    assert phys("0,,1") == [0]
    assert phys("0,1,") == [0, 1]
    assert phys("x") == []


def test_ordinals_are_read_like_strtoul():
    assert phys("1gpu,0") == [1, 0]


def test_a_device_named_twice_hides_every_device():
    vis = resolve_visible_devices("0,1,0", DEVICES)
    assert vis.targets == ()
    assert "twice" in vis.note
    assert phys(f"{U1},{U1[:12]}") == []


def test_full_uuids_and_prefixes():
    assert phys(f"{U2},{U0}") == [2, 0]
    assert phys("GPU-c0ff,GPU-8f3a") == [2, 0]
    # An exact UUID wins even if it is also a prefix of nothing else.
    assert phys(U1) == [1]


def test_ambiguous_prefix_is_an_error_naming_the_candidates():
    with pytest.raises(DeviceNotFoundError) as info:
        visible_targets("GPU-8f3", DEVICES)
    msg = str(info.value)
    assert "ambiguous" in msg
    assert "GPU 0" in msg and "GPU 1" in msg


def test_unknown_uuid_is_an_error_listing_present_gpus():
    with pytest.raises(DeviceNotFoundError) as info:
        visible_targets(f"{U0},GPU-deadbeef", DEVICES)
    msg = str(info.value)
    assert "'GPU-deadbeef'" in msg and "matches no GPU" in msg
    assert U2 in msg
    assert "nvidia-smi -L" in msg


def test_non_strict_mode_stops_like_cuda():
    vis = resolve_visible_devices(f"{U0},GPU-deadbeef,{U2}", DEVICES, strict=False)
    assert vis.targets == (VisibleTarget(0),)
    assert vis.ignored == ("GPU-deadbeef", U2)
    assert phys("GPU-8f3", strict=False) == []


def test_kind_of_list_is_set_by_first_entry():
    assert phys(f"{U1},0") == [1]  # an ordinal after UUIDs ends the list
    assert phys(f"0,{U1}") == [0]  # and a UUID after ordinals
    assert phys(f"{U1},{M20}") == [1]


def test_mig_uuids_and_prefixes():
    assert visible_targets(M21, DEVICES) == [VisibleTarget(2, M21)]
    # A process enumerates one MIG device only: the first listed.
    vis = resolve_visible_devices(f"{M21},{M20},{U0}", DEVICES)
    assert vis.targets == (VisibleTarget(2, M21),)
    assert vis.ignored == (M20, U0) and "only one MIG device" in vis.note
    assert visible_targets("MIG-1a2b3", DEVICES) == [VisibleTarget(2, M20)]
    with pytest.raises(DeviceNotFoundError, match="ambiguous"):
        visible_targets("MIG-1a2b", DEVICES)
    with pytest.raises(DeviceNotFoundError, match="matches no MIG device"):
        visible_targets("MIG-ffff", DEVICES)


def test_legacy_mig_form():
    assert visible_targets(f"MIG-{U2}/2/0", DEVICES) == [VisibleTarget(2, M21)]
    assert visible_targets("MIG-GPU-c0ffee/1/0", DEVICES) == [VisibleTarget(2, M20)]
    with pytest.raises(DeviceNotFoundError, match="no MIG device with GPU instance 5"):
        visible_targets(f"MIG-{U2}/5/0", DEVICES)
    with pytest.raises(DeviceNotFoundError, match="matches no GPU UUID"):
        visible_targets("MIG-GPU-77777777/1/0", DEVICES)


def test_mig_devices_as_plain_strings():
    devices = [(0, U0, [M20, M21])]
    assert visible_targets(M20, devices) == [VisibleTarget(0, M20)]
    # Without instance ids the legacy form cannot be resolved.
    with pytest.raises(DeviceNotFoundError):
        visible_targets(f"MIG-{U0}/1/0", devices)


def test_no_devices_present():
    assert visible_targets(None, []) == []
    assert visible_targets("0", []) == []
    with pytest.raises(DeviceNotFoundError, match="none"):
        visible_targets("GPU-8f3a", [])


def test_ordinals_count_only_the_gpus_present():
    # NVML counted GPU 0 but cannot open it (no permission in a cgroup): CUDA does not see it
    # either, so ordinals number the GPUs present, as when the variable is unset.
    present = [(1, U1, []), (2, U2, [])]
    assert phys(None, present) == [1, 2]
    assert phys("0,1", present) == [1, 2]
    assert phys("1", present) == [2]
    vis = resolve_visible_devices("2", present)
    assert vis.targets == () and "only 2 GPU(s) are present" in vis.note
