"""A kernel package's WGSL templates, rendered with Jinja2.

A pass names a template in its package folder or in the shared ``kernels/common/`` folder.
Rendering is strict (``StrictUndefined``: a missing value is an error, never an empty
string); the generated ``@group(0) @binding(i)`` declarations
(``common/bindings.wgsl.jinja``, with ``enable f16;`` when a binding is ``f16``) reach every
template as the variable ``bindings``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from onnx_moe_fuse.kernels.manifest_model import KernelManifest, iter_passes
from onnx_moe_fuse.kernels.planner import KernelCallError

COMMON_TEMPLATES = Path(__file__).resolve().parent / "common"


class ShaderTemplates:
    """The templates a package's passes may name: its own folder first, then the common one."""

    def __init__(self, manifest: KernelManifest, folder: Path):
        self.folder = folder
        loader = jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(str(folder)), jinja2.FileSystemLoader(str(COMMON_TEMPLATES))]
        )
        self.env = jinja2.Environment(
            loader=loader,
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
        )
        # A missing template is a packaging error: report it when the package is opened, not
        # at the first call that happens to pick the variant.
        for v in manifest.variants:
            for p in iter_passes(v.passes):
                if (
                    not (folder / p.shader).is_file()
                    and not (COMMON_TEMPLATES / p.shader).is_file()
                ):
                    raise KernelCallError(
                        f"{manifest.path}: pass {p.id} names a missing shader {p.shader!r}"
                    )

    def render(self, shader: str, constants: dict[str, Any], decls: list[dict]) -> str:
        """Render a pass template: constants plus the generated binding declarations."""
        declarations = self.env.get_template("bindings.wgsl.jinja").render(
            bindings=[{**facts, "index": i} for i, facts in enumerate(decls)],
            enable_f16=any("f16" in (facts["element"] or "") for facts in decls),
        )
        try:
            return self.env.get_template(shader).render(**constants, bindings=declarations)
        except jinja2.UndefinedError as exc:
            raise KernelCallError(f"{self.folder / shader}: {exc.message}") from None
