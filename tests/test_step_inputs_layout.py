"""The CUDA executor publishes a step's nine int32 input arrays with one staging copy into one device
buffer (cuda_exec.input_layout): the regions must be disjoint, 16-byte aligned and inside the buffer."""

import numpy as np
import pytest

from ninfer_rt.cuda.memory import DeviceBuffer, DeviceView
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_step_inputs import STEP_INPUTS, input_layout


def test_regions_are_disjoint_aligned_and_sized_for_their_arrays() -> None:
    buffer = DeviceBuffer(StreamSet(), 4096, "step.inputs")
    lengths = dict(zip(STEP_INPUTS, [3, 3, 2, 1, 2 * 64, 3, 0]))
    layout = input_layout(buffer, lengths)
    spans = sorted((4 * offset, 4 * offset + layout.views[name].nbytes) for name, offset in zip(lengths, layout.offsets))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(start % 16 == 0 for start, _ in spans)
    assert spans[-1][1] <= 4 * layout.size <= buffer.nbytes
    assert [layout.views[name].nbytes for name in lengths] == [4 * max(n, 1) for n in lengths.values()]


def test_a_view_aliases_its_parents_bytes_and_resource() -> None:
    buffer = DeviceBuffer(StreamSet(), 64, "parent")
    view = DeviceView(buffer, 16, 32, "child")
    view.host_bytes()[:] = 7
    assert view.resource == buffer.resource
    np.testing.assert_array_equal(buffer.host_bytes()[16:48], 7)
    assert buffer.host_bytes()[:16].sum() == 0 and buffer.host_bytes()[48:].sum() == 0


def test_a_view_past_its_parent_is_refused() -> None:
    with pytest.raises(ValueError, match="outside parent"):
        DeviceView(DeviceBuffer(StreamSet(), 64, "parent"), 48, 32, "child")
