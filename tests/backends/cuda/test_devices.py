"""Device listing with a fake torch.cuda and a fake pynvml (no GPU needed)."""

from __future__ import annotations

import types
import uuid as uuidlib
import warnings

import pytest
import torch

import dptune
from dptune.hardware import nvml as _nvml
from dptune.cli.devices import GpuInfo, devices, format_devices

GiB = 2**30


# ---- fakes -----------------------------------------------------------------------------

class FakeCUuuid:
    """Like torch's ``_CUuuid``: ``.bytes`` and a dashed ``str`` without a prefix."""

    def __init__(self, text):
        self._u = uuidlib.UUID(text)

    @property
    def bytes(self):
        return list(self._u.bytes)

    def __str__(self):
        return str(self._u)


class Card:
    def __init__(self, uuid, bus, pci_bus, name, total, used):
        self.uuid, self.bus, self.pci_bus, self.name = uuid, bus, pci_bus, name
        self.total, self.used = total, used


# physical cards; CUDA orders them differently from NVML (which uses PCI order)
CARDS = [
    Card("1b2a3c4d-0000-1111-2222-333344445555", "00000000:3B:00.0", 0x3B, "GPU-A", 24 * GiB, 1 * GiB),
    Card("9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff", "00000000:5E:00.0", 0x5E, "GPU-B", 48 * GiB, 5 * GiB),
    Card("00112233-4455-6677-8899-aabbccddeeff", "00000000:86:00.0", 0x86, "GPU-C", 80 * GiB, 7 * GiB),
]


def fake_torch_cuda(monkeypatch, cuda_order, *, uuid_kind="object", available=True):
    """torch.cuda that sees ``[CARDS[i] for i in cuda_order]`` (indices 0..n-1)."""
    visible = [CARDS[i] for i in cuda_order]
    calls = {"props": 0}

    def props(i):
        calls["props"] += 1
        c = visible[i]
        u = {"object": FakeCUuuid(c.uuid), "str": c.uuid, "none": None}[uuid_kind]
        return types.SimpleNamespace(name=c.name, total_memory=c.total, uuid=u,
                                     pci_domain_id=0, pci_bus_id=c.pci_bus, pci_device_id=0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: visible[i].name)
    return calls


def fake_pynvml(*, init_error=False, v2=True, not_supported=(), uuid_bytes=False):
    """A stand-in for the pynvml module over CARDS, in NVML (PCI) order."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVMLError_NotSupported = NVMLError_NotSupported
    m.nvmlMemory_v2 = 0x2000028
    m.log = []

    def init():
        m.log.append("init")
        if init_error:
            raise NVMLError_DriverNotLoaded("Driver Not Loaded")

    def meminfo(h, version=None):
        c = CARDS[h]
        if c.name in not_supported:
            raise NVMLError_NotSupported("Not Supported")
        if version is not None:
            if not v2:
                raise NVMLError_FunctionNotFound("Function Not Found")
            m.log.append("v2")
            return types.SimpleNamespace(total=c.total + GiB, free=c.total - c.used,
                                         used=c.used, reserved=GiB, version=version)
        m.log.append("v1")
        return types.SimpleNamespace(total=c.total, free=c.total - c.used, used=c.used)

    def get_uuid(h):
        text = "GPU-" + CARDS[h].uuid
        return text.encode() if uuid_bytes else text

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.log.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(CARDS)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = get_uuid
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=CARDS[h].bus.encode())
    m.nvmlDeviceGetMemoryInfo = meminfo
    return m


@pytest.fixture(autouse=True)
def fresh_nvml():
    _nvml.reset()
    yield
    _nvml.reset()


def use_nvml(monkeypatch, module):
    monkeypatch.setattr(_nvml, "_import_pynvml", lambda: module)


def nvml_warnings(rec):
    return [r for r in rec if "NVML is not available" in str(r.message)]


# ---- no CUDA -----------------------------------------------------------------------------

def test_no_cuda_gives_empty_list_without_touching_cuda_or_nvml(monkeypatch):
    calls = fake_torch_cuda(monkeypatch, [0, 1], available=False)
    m = fake_pynvml()
    use_nvml(monkeypatch, m)
    assert devices() == []
    assert calls["props"] == 0 and m.log == []


def test_real_machine_without_cuda():
    if torch.cuda.is_available():
        assert all(isinstance(g, GpuInfo) for g in devices())
    else:
        assert devices() == []
        assert not torch.cuda.is_initialized()


def test_package_level_function_survives_submodule_import():
    import dptune.cli.devices as mod

    assert dptune.devices is mod.devices and callable(dptune.devices)
    assert dptune.devices() == devices()
    assert mod.GpuInfo is GpuInfo


# ---- matching torch to NVML ------------------------------------------------------------

@pytest.mark.parametrize("uuid_kind", ["object", "str"])
def test_uuid_matching_when_orders_differ(monkeypatch, uuid_kind):
    fake_torch_cuda(monkeypatch, [2, 0, 1], uuid_kind=uuid_kind)
    m = fake_pynvml()
    use_nvml(monkeypatch, m)
    gpus = devices()
    assert [g.index for g in gpus] == [0, 1, 2]
    assert [g.name for g in gpus] == ["GPU-C", "GPU-A", "GPU-B"]
    assert [g.used_bytes for g in gpus] == [7 * GiB, 1 * GiB, 5 * GiB]
    assert [g.total_bytes for g in gpus] == [80 * GiB, 24 * GiB, 48 * GiB]
    assert gpus[0].uuid == "GPU-00112233-4455-6677-8899-aabbccddeeff"
    assert gpus[0].pci_bus_id == "00000000:86:00.0"
    assert [g.nvml_handle for g in gpus] == [2, 0, 1]
    assert "v2" in m.log and "v1" not in m.log


def test_pci_fallback_when_torch_has_no_uuid(monkeypatch):
    fake_torch_cuda(monkeypatch, [1, 0], uuid_kind="none")
    use_nvml(monkeypatch, fake_pynvml(uuid_bytes=True))
    gpus = devices()
    assert [g.nvml_handle for g in gpus] == [1, 0]
    assert [g.used_bytes for g in gpus] == [5 * GiB, 1 * GiB]
    assert gpus[0].uuid == "GPU-" + CARDS[1].uuid       # bytes from NVML decoded


def test_a_subset_of_cards_visible(monkeypatch):
    # CUDA_VISIBLE_DEVICES=2: torch sees one card, index 0, which is NVML's third
    fake_torch_cuda(monkeypatch, [2])
    use_nvml(monkeypatch, fake_pynvml())
    (g,) = devices()
    assert (g.index, g.name, g.used_bytes, g.nvml_handle) == (0, "GPU-C", 7 * GiB, 2)


def test_v1_fallback(monkeypatch):
    fake_torch_cuda(monkeypatch, [0])
    m = fake_pynvml(v2=False)
    use_nvml(monkeypatch, m)
    assert devices()[0].used_bytes == 1 * GiB
    assert "v1" in m.log


def test_not_supported_query_gives_none(monkeypatch):
    fake_torch_cuda(monkeypatch, [0, 1])
    use_nvml(monkeypatch, fake_pynvml(not_supported={"GPU-B"}))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        gpus = devices()
    assert [g.used_bytes for g in gpus] == [1 * GiB, None]
    assert gpus[1].nvml_handle == 1 and gpus[1].uuid == "GPU-" + CARDS[1].uuid
    assert nvml_warnings(rec) == []


# ---- NVML missing ---------------------------------------------------------------------------

def test_init_failure_warns_once_and_gives_allocator_data(monkeypatch):
    fake_torch_cuda(monkeypatch, [1, 0])
    m = fake_pynvml(init_error=True)
    use_nvml(monkeypatch, m)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = devices()
        second = devices()
    assert len(nvml_warnings(rec)) == 1
    assert "nvmlInit failed" in str(nvml_warnings(rec)[0].message)
    assert "nvidia-ml-py" in str(nvml_warnings(rec)[0].message)
    assert m.log == ["init"]                        # not retried
    assert first == second
    assert [g.used_bytes for g in first] == [None, None]
    assert [g.name for g in first] == ["GPU-B", "GPU-A"]
    assert [g.total_bytes for g in first] == [48 * GiB, 24 * GiB]
    assert first[0].uuid == "GPU-" + CARDS[1].uuid   # torch's UUID, formatted
    assert first[0].pci_bus_id == "00000000:5E:00.0"


def test_import_error_warns_once(monkeypatch):
    fake_torch_cuda(monkeypatch, [0])

    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(_nvml, "_import_pynvml", missing)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert devices()[0].used_bytes is None
        assert devices()[0].used_bytes is None
        assert _nvml.nvml() is None
    assert len(nvml_warnings(rec)) == 1
    assert "cannot import pynvml" in str(nvml_warnings(rec)[0].message)


# ---- _nvml helpers ------------------------------------------------------------------------

def test_nvml_initialises_once_and_shuts_down_on_reset(monkeypatch):
    m = fake_pynvml()
    use_nvml(monkeypatch, m)
    assert _nvml.nvml() is m and _nvml.nvml() is m
    assert m.log == ["init"]
    _nvml.reset()
    assert m.log == ["init", "shutdown"]


def test_reset_with_module_injects_it():
    m = fake_pynvml()
    _nvml.reset(m)
    assert _nvml.nvml() is m
    assert _nvml.handles() == [0, 1, 2]


def test_nvml_helpers(monkeypatch):
    use_nvml(monkeypatch, fake_pynvml())
    h = _nvml.handle_by_uuid("GPU-" + CARDS[1].uuid.upper())
    assert h == 1
    assert _nvml.handle_by_uuid(CARDS[2].uuid.replace("-", "")) == 2
    assert _nvml.handle_by_uuid("GPU-00000000-0000-0000-0000-000000000000") is None
    assert _nvml.handle_by_uuid(None) is None
    assert _nvml.handle_by_pci("0000:5e:00.0") == 1
    assert _nvml.handle_by_pci("00000000:86:00.0") == 2
    assert _nvml.handle_by_pci("nonsense") is None
    assert _nvml.device_uuid(0) == "GPU-" + CARDS[0].uuid
    assert _nvml.device_pci_bus_id(0) == "00000000:3B:00.0"
    mem = _nvml.memory_info(1)
    assert mem == _nvml.MemoryInfo(total=49 * GiB, free=43 * GiB, used=5 * GiB)
    total, free, used = mem
    assert isinstance(total, int)
    assert _nvml.memory_info(None) is None


def test_helpers_without_nvml(monkeypatch):
    use_nvml(monkeypatch, fake_pynvml(init_error=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _nvml.handles() == []
        assert _nvml.handle_by_uuid(CARDS[0].uuid) is None
        assert _nvml.memory_info(0) is None
        assert _nvml.device_uuid(0) is None


def test_mig_uuid_never_matches_a_whole_card(monkeypatch):
    assert _nvml.normalize_uuid("MIG-" + CARDS[0].uuid) != _nvml.normalize_uuid(CARDS[0].uuid)
    fake_torch_cuda(monkeypatch, [0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        name="MIG 1g.10gb", total_memory=10 * GiB, uuid="MIG-" + CARDS[0].uuid,
        pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0))
    use_nvml(monkeypatch, fake_pynvml())
    (g,) = devices()
    assert g.used_bytes is None and g.nvml_handle is None
    assert g.uuid.startswith("MIG-")


@pytest.mark.parametrize("text, expected", [
    ("00000000:3B:00.0", (0, 0x3B, 0, 0)),
    ("0001:af:1f.1", (1, 0xAF, 0x1F, 1)),
    (b"00000000:3b:00.0", (0, 0x3B, 0, 0)),
    ("3b:00.0", (0, 0x3B, 0, 0)),
    ("garbage", None),
    (None, None),
])
def test_normalize_pci(text, expected):
    assert _nvml.normalize_pci(text) == expected


# ---- GpuInfo and the table ------------------------------------------------------------------

def test_gpuinfo_equality():
    a = GpuInfo(index=1, name="X", total_bytes=8 * GiB, used_bytes=2 * GiB, uuid="GPU-1",
                pci_bus_id="00000000:01:00.0", nvml_handle=object())
    b = GpuInfo(index=1, name="X", total_bytes=8 * GiB, used_bytes=2 * GiB, uuid="GPU-1",
                pci_bus_id="00000000:01:00.0", nvml_handle=object())
    assert a == b and "nvml_handle" not in repr(a)
    with pytest.raises(AttributeError):
        a.index = 2  # frozen


def test_format_devices():
    gpus = [GpuInfo(0, "NVIDIA H100", 80 * GiB, 3 * GiB, "GPU-abc"),
            GpuInfo(1, "NVIDIA A10", 24 * GiB, None, None)]
    text = format_devices(gpus)
    lines = text.splitlines()
    assert lines[0].split() == ["index", "name", "total", "used", "uuid"]
    assert "NVIDIA H100" in lines[1] and "80.0 GiB" in lines[1] and "3.0 GiB" in lines[1]
    assert "GPU-abc" in lines[1]
    assert "n/a" in lines[2]
    assert "NVML" in lines[-1]


def test_format_no_devices():
    text = format_devices([])
    assert "no CUDA GPU is visible" in text and "CUDA_VISIBLE_DEVICES" in text


# ---- one device layer: `dptune devices` and the backend's runtime agree ------------------

@pytest.mark.parametrize("uuid_kind", ["object", "str", "none"])
def test_the_runtime_finds_the_cards_devices_finds(monkeypatch, uuid_kind):
    """Both go through the same matching (UUID, then PCI bus id) and the same UUID text: the
    runtime's NVML figures are the listed cards' own, also where torch gives no UUID."""
    from dptune.hardware.runtime import CudaRuntime

    fake_torch_cuda(monkeypatch, [2, 0, 1], uuid_kind=uuid_kind)
    use_nvml(monkeypatch, fake_pynvml())
    gpus = devices()
    rt = CudaRuntime()
    assert [rt._handle(i) for i in range(3)] == [g.nvml_handle for g in gpus] == [2, 0, 1]
    assert [rt.nvml_used(i) for i in range(3)] == [g.used_bytes for g in gpus] == [7 * GiB, 1 * GiB, 5 * GiB]
    if uuid_kind != "none":
        assert [rt.uuid(i) for i in range(3)] == [g.uuid for g in gpus]
        assert rt.uuid(0) == "GPU-00112233-4455-6677-8899-aabbccddeeff"


def test_a_mig_instance_is_not_matched_and_is_written_alike(monkeypatch):
    from dptune.hardware.devices import format_uuid, nvml_handle
    from dptune.hardware.runtime import CudaRuntime

    use_nvml(monkeypatch, fake_pynvml())
    mig = "MIG-" + CARDS[0].uuid
    asked = []
    assert nvml_handle(mig, lambda: asked.append(1) or CARDS[0].bus) is None and asked == []
    assert format_uuid(_nvml.normalize_uuid(mig)) == "MIG-" + CARDS[0].uuid.replace("-", "")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=mig, pci_domain_id=0,
                                                        pci_bus_id=CARDS[0].pci_bus, pci_device_id=0))
    rt = CudaRuntime()
    assert rt.uuid(0) == format_uuid(_nvml.normalize_uuid(mig)) and rt.nvml_used(0) is None
