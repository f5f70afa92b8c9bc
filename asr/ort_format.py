"""Turn an ORT-format model (`.ort`, onnxruntime's flatbuffer format) back into an ONNX model.

onnxruntime loads `.ort` files with only the graph optimisations that were applied when the file was
written. Moonshine's decoder was written with its int8 weights dequantised *inside* the graph (Cast, Mul,
Add on 41 MB of initializers), so every decoding step re-dequantises all of them: ~60 ms a token on two
cores. As ONNX, onnxruntime's constant folding runs once at load and a step costs a few milliseconds.

Only what a model needs to run is carried over: nodes (with sub-graphs), initializers, the value infos of
graph inputs/outputs, opset imports. Runtime optimisation records and kernel hashes are dropped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import TYPE_CHECKING, Any

import numpy as np

from duplex.base.errors import ModelError

if TYPE_CHECKING:
    import onnx


def _tools_without_torch() -> None:
    """Make `onnxruntime.tools` importable without running its `__init__`, which imports torch whenever
    torch is installed (200 MB in a server whose torch stages run in another process) for an export
    helper this module never uses."""
    if "onnxruntime.tools" in sys.modules:
        return
    spec = importlib.util.find_spec("onnxruntime.tools")
    if spec is None or not spec.submodule_search_locations:
        return
    package = types.ModuleType("onnxruntime.tools")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["onnxruntime.tools"] = package


def _fbs() -> Any:
    try:
        _tools_without_torch()
        from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs
    except ImportError as exc:
        raise ModelError(
            f"reading .ort files needs onnxruntime's tools ({exc}): pip install 'onnxruntime>=1.18'"
        ) from None
    return fbs


def _str(b: bytes | None) -> str:
    return b.decode("utf-8") if b else ""


def _tensor(t: Any) -> onnx.TensorProto:
    import onnx

    out = onnx.TensorProto()
    out.name = _str(t.Name())
    out.data_type = t.DataType()
    out.dims.extend(t.Dims(i) for i in range(t.DimsLength()))
    if t.StringDataLength():
        out.string_data.extend(t.StringData(i) for i in range(t.StringDataLength()))
    elif t.RawDataLength():
        out.raw_data = t.RawDataAsNumpy().tobytes()
    elif t.ExternalDataOffset() > 0:
        raise ModelError(f"initializer {out.name!r} keeps its data outside the .ort file; not supported")
    return out


def _value_type(info: Any, fbs: Any) -> onnx.TypeProto | None:
    import onnx

    type_info = info.Type()
    if type_info is None or type_info.ValueType() != fbs.TypeInfoValue.TypeInfoValue.tensor_type:
        return None
    table = type_info.Value()
    tensor = fbs.TensorTypeAndShape.TensorTypeAndShape()
    tensor.Init(table.Bytes, table.Pos)
    proto = onnx.TypeProto()
    proto.tensor_type.elem_type = tensor.ElemType()
    shape = tensor.Shape()
    if shape is not None:
        dims = proto.tensor_type.shape.dim
        for i in range(shape.DimLength()):
            value = shape.Dim(i).Value()
            dim = dims.add()
            if value is None:
                continue
            if value.DimType() == fbs.DimensionValueType.DimensionValueType.VALUE:
                dim.dim_value = value.DimValue()
            elif value.DimType() == fbs.DimensionValueType.DimensionValueType.PARAM:
                dim.dim_param = _str(value.DimParam())
    return proto


def _attribute(a: Any, fbs: Any) -> onnx.AttributeProto:
    import onnx

    kind = onnx.AttributeProto.AttributeType
    out = onnx.AttributeProto()
    out.name = _str(a.Name())
    out.type = a.Type()
    if out.type == kind.FLOAT:
        out.f = a.F()
    elif out.type == kind.INT:
        out.i = a.I()
    elif out.type == kind.STRING:
        out.s = a.S() or b""
    elif out.type == kind.TENSOR:
        out.t.CopyFrom(_tensor(a.T()))
    elif out.type == kind.GRAPH:
        out.g.CopyFrom(_graph(a.G(), fbs, "subgraph"))
    elif out.type == kind.FLOATS:
        out.floats.extend(a.Floats(i) for i in range(a.FloatsLength()))
    elif out.type == kind.INTS:
        out.ints.extend(a.Ints(i) for i in range(a.IntsLength()))
    elif out.type == kind.STRINGS:
        out.strings.extend(a.Strings(i) for i in range(a.StringsLength()))
    elif out.type == kind.TENSORS:
        out.tensors.extend(_tensor(a.Tensors(i)) for i in range(a.TensorsLength()))
    elif out.type == kind.GRAPHS:
        out.graphs.extend(_graph(a.Graphs(i), fbs, "subgraph") for i in range(a.GraphsLength()))
    else:
        raise ModelError(f"attribute {out.name!r} has type {out.type}, which this reader does not carry over")
    return out


def _graph(g: Any, fbs: Any, name: str) -> onnx.GraphProto:
    import onnx

    out = onnx.GraphProto()
    out.name = name
    infos = {}
    for i in range(g.NodeArgsLength()):
        arg = g.NodeArgs(i)
        infos[_str(arg.Name())] = arg
    for i in range(g.NodesLength()):
        node = g.Nodes(i)
        if node.Type() != fbs.NodeType.NodeType.Primitive:
            raise ModelError(f"node {_str(node.Name())!r} is a fused node, which only its runtime can run")
        proto = out.node.add()
        proto.name = _str(node.Name())
        proto.op_type = _str(node.OpType())
        proto.domain = _str(node.Domain())
        proto.input.extend(_str(node.Inputs(j)) for j in range(node.InputsLength()))
        proto.output.extend(_str(node.Outputs(j)) for j in range(node.OutputsLength()))
        proto.attribute.extend(_attribute(node.Attributes(j), fbs) for j in range(node.AttributesLength()))
    out.initializer.extend(_tensor(g.Initializers(i)) for i in range(g.InitializersLength()))
    if g.SparseInitializersLength():
        raise ModelError("sparse initializers are not carried over")
    for name_at, count, field in (
        (g.Inputs, g.InputsLength(), out.input),
        (g.Outputs, g.OutputsLength(), out.output),
    ):
        for i in range(count):
            value_name = _str(name_at(i))
            info = field.add()
            info.name = value_name
            arg = infos.get(value_name)
            value_type = _value_type(arg, fbs) if arg is not None else None
            if value_type is not None:
                info.type.CopyFrom(value_type)
    return out


def ort_to_onnx(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The ONNX model an `.ort` file holds (ModelError if it is not one or uses what cannot be carried over)."""
    import onnx

    fbs = _fbs()
    data = np.fromfile(path, dtype=np.uint8).tobytes()
    if not fbs.InferenceSession.InferenceSession.InferenceSessionBufferHasIdentifier(data, 0):
        raise ModelError(f"{path} is not an ORT-format model (no 'ORTM' identifier)")
    model = fbs.InferenceSession.InferenceSession.GetRootAsInferenceSession(data, 0).Model()
    if model is None or model.Graph() is None:
        raise ModelError(f"{path} holds no model graph")
    out = onnx.ModelProto()
    out.ir_version = model.IrVersion()
    out.producer_name = _str(model.ProducerName())
    out.producer_version = _str(model.ProducerVersion())
    out.domain = _str(model.Domain())
    out.model_version = model.ModelVersion()
    for i in range(model.OpsetImportLength()):
        opset = out.opset_import.add()
        opset.domain = _str(model.OpsetImport(i).Domain())
        opset.version = model.OpsetImport(i).Version()
    out.graph.CopyFrom(_graph(model.Graph(), fbs, os.path.basename(os.fspath(path))))
    return out
