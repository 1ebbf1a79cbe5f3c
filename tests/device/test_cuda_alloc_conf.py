"""PYTORCH_CUDA_ALLOC_CONF parsed as c10 parses it: values, defaults, and the strings torch's own parser refuses."""

import pytest
import torch

from memfit.device.cuda_alloc_conf import ENV_VARS, AllocatorConfig

MiB = 1 << 20


def test_defaults_are_c10s():
    conf = AllocatorConfig.parse("")
    assert conf == AllocatorConfig()
    assert conf.max_split_size is None and conf.max_non_split_rounding_size == 20 * MiB
    assert conf.large_segment_size == 20 * MiB and not conf.expandable_segments
    assert conf.garbage_collection_threshold == 0.0 and conf.roundup_power2_divisions == (0,) * 16


def test_values_in_bytes_and_whitespace_ignored():
    conf = AllocatorConfig.parse(" max_split_size_mb : 128 , expandable_segments:True, "
                                 "garbage_collection_threshold:0.6,")
    assert conf.max_split_size == 128 * MiB and conf.expandable_segments
    assert conf.garbage_collection_threshold == 0.6


def test_large_segment_size_sets_the_floor_and_the_rounding_default():
    conf = AllocatorConfig.parse("max_split_size_mb:64,large_segment_size_mb:32")   # read first whatever its place
    assert conf.large_segment_size == 32 * MiB and conf.max_non_split_rounding_size == 32 * MiB
    with pytest.raises(ValueError, match="max_split_size_mb must be >= 32"):
        AllocatorConfig.parse("large_segment_size_mb:32,max_split_size_mb:30")
    with pytest.raises(ValueError, match="large_segment_size_mb must be > 10"):
        AllocatorConfig.parse("large_segment_size_mb:10")


@pytest.mark.parametrize("text, expected", [
    ("roundup_power2_divisions:4", (4,) * 16),
    # 64 MiB is interval 6: the first entry fills every interval below it; '>' every one after the last named
    ("roundup_power2_divisions:[64:8,128:2,>:1]", (8,) * 7 + (2,) + (1,) * 8),
    ("roundup_power2_divisions:[1:4, 2:8, >:2]", (4, 8) + (2,) * 14),
    ("roundup_power2_divisions:[256:4]", (4,) * 9 + (0,) * 7),
])
def test_roundup_power2_divisions_as_c10_fills_its_intervals(text, expected):
    assert AllocatorConfig.parse(text).roundup_power2_divisions == expected


def test_divisions_of_a_size_by_its_highest_bit():
    conf = AllocatorConfig.parse("roundup_power2_divisions:[1:2,2:4,>:8]")
    assert [conf.divisions(n) for n in (512, MiB, 2 * MiB - 1, 2 * MiB, 64 << 30)] == [2, 2, 2, 4, 8]


@pytest.mark.parametrize("text, message", [
    ("bogus:1", "unknown option 'bogus'"),
    ("max_split_size_mb", "needs a value"),
    ("max_split_size_mb:10", "max_split_size_mb must be >= 20"),
    ("max_split_size_mb:40.5", "needs a whole number, found '40.5'"),
    ("max_split_size_mb:-5", "needs a whole number"),
    ("expandable_segments:true", "True or False"),
    ("garbage_collection_threshold:1.0", r"in \(0.0, 1.0\)"),
    ("per_process_memory_fraction:1.5", r"in \[0.0, 1.0\]"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[3:4]", "intervals must be a power of 2"),
    ("roundup_power2_divisions:[64:8", "never closes"),
    ("max_split_size_mb:40;expandable_segments:True", "expected ',' after option 'max_split_size_mb'"),
    ("max_split_size_mb:40,,expandable_segments:True", "unknown option ','"),
    ("max_split_size_mb:40,max_split_size_mb:50", "given twice"),
    ("backend:mine", "'native' or 'cudaMallocAsync'"),
])
def test_bad_strings_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig.parse(text)


def test_pinned_and_locking_options_are_accepted_and_kept_aside():
    conf = AllocatorConfig.parse("pinned_num_register_threads:4,release_lock_on_cudamalloc:True")
    assert conf.ignored == (("pinned_num_register_threads", "4"), ("release_lock_on_cudamalloc", "True"))
    assert conf == AllocatorConfig()                   # nothing of the device pool changed
    with pytest.raises(ValueError, match="release_lock_on_cudamalloc needs True or False"):
        AllocatorConfig.parse("release_lock_on_cudamalloc:yes")


def test_from_env_reads_the_first_variable_set_in_c10s_order():
    assert ENV_VARS[0] == "PYTORCH_CUDA_ALLOC_CONF"
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:32"}
    assert AllocatorConfig.from_env(env).max_split_size == 32 * MiB
    assert AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    assert AllocatorConfig.from_env({}) == AllocatorConfig()
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF='x:1': unknown option"):
        AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "x:1"})


@pytest.fixture
def torch_parser():
    """torch's own parser (c10's AcceleratorAllocatorConfig::parseArgs, through a private binding); the settings it
    leaves are put back to c10's defaults after (every key the strings below touch)."""
    parse = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if parse is None:
        pytest.skip(f"torch {torch.__version__} has no torch._C._accelerator_setAllocatorSettings")
    yield parse
    parse("large_segment_size_mb:20,max_non_split_rounding_mb:20,expandable_segments:False")
    parse("")


@pytest.mark.parametrize("text", [
    "max_split_size_mb:40", "max_split_size_mb:10", "max_split_size_mb:20", "expandable_segments:True",
    "expandable_segments:true", "garbage_collection_threshold:0.5", "garbage_collection_threshold:1.5",
    "roundup_power2_divisions:[64:8,>:1]", "roundup_power2_divisions:[3:4]", "roundup_power2_divisions:3",
    "roundup_power2_divisions:1", "large_segment_size_mb:40,max_split_size_mb:30",
    "large_segment_size_mb:10", "max_non_split_rounding_mb:19", "max_split_size_mb:64,max_non_split_rounding_mb:40",
])
def test_accepts_and_refuses_what_torchs_parser_does(torch_parser, text):
    """The reference: c10's parser in this torch. (A CPU build of torch accepts unknown keys, having no CUDA parser
    to check them: those are compared by hand above.)"""
    try:
        torch_parser(text)
        torch_accepts = True
    except (ValueError, RuntimeError):
        torch_accepts = False
    finally:
        torch_parser("large_segment_size_mb:20,max_non_split_rounding_mb:20")
    try:
        AllocatorConfig.parse(text)
        memfit_accepts = True
    except ValueError:
        memfit_accepts = False
    assert memfit_accepts == torch_accepts
