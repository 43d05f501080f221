"""A preset's ``parallel:`` section sets the optimizer-offload fields of ModelShape (issue 67's
main_grad_bytes, optimizer_offload_fraction, overlap_optimizer_d2h_h2d), with the shape's own
validation: a real preset file, read as ``ssdtrain plan --config`` reads it."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.tools.plan.cli import read_preset

PRESET = """\
model: {{num_layers: 4, hidden: 64, heads: 4, ffn_hidden: 256, seq_len: 32, micro_batch: 2}}
parallel:
  dp: 2
  distributed_optimizer: {dist}
  main_grad_bytes: 2
  optimizer_offload_fraction: {fraction}
  overlap_optimizer_d2h_h2d: true
offload: {{dirs: ["{root}"]}}
"""


def test_a_preset_sets_the_gradient_precision_and_megatrons_optimizer_offload(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(PRESET.format(dist="true", fraction=0.5, root=tmp_path))
    shape, _ = read_preset(str(path))
    assert (shape.main_grad_bytes, shape.optimizer_offload_fraction,
            shape.overlap_optimizer_d2h_h2d) == (2, 0.5, True)


@pytest.mark.parametrize("dist, fraction, message", [
    ("true", 1.5, "ModelShape.optimizer_offload_fraction=1.5 is invalid: expected a fraction in [0, 1]"),
    ("false", 0.5, "ModelShape.optimizer_offload_fraction=0.5 is invalid: needs distributed_optimizer"),
])
def test_a_bad_optimizer_offload_in_a_preset_is_one_line_naming_the_file_and_field(
        tmp_path, dist, fraction, message):
    path = tmp_path / "job.yaml"
    path.write_text(PRESET.format(dist=dist, fraction=fraction, root=tmp_path))
    with pytest.raises(ValueError) as err:
        read_preset(str(path))
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)
