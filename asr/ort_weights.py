"""Read a packaged `.ort` model's weights as float32 arrays, by the node that uses them.

Moonshine's `.ort` files keep their int8 weights quantised: each weight a node reads is the output of a small
Cast -> Mul (scale) -> Add (offset) chain over initializers. `GraphWeights` follows such chains back to the
initializers and evaluates them in numpy, so the torch ports of Moonshine's encoder and decoder
(asr/moonshine_stream.py, asr/moonshine_decoder.py) load exactly what onnxruntime runs. Nodes inside `If`
branches (the merged decoder's two paths) are looked up too.
"""

from __future__ import annotations

import numpy as np


class GraphWeights:
    """The weights of an ONNX graph (`onnx.GraphProto`), looked up by the name of the node that reads them."""

    def __init__(self, graph) -> None:  # graph: onnx.GraphProto
        from onnx import numpy_helper

        self._init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self._producer = {o: n for n in graph.node for o in n.output}
        self._nodes: dict = {}

        def add(g) -> None:
            for n in g.node:
                self._nodes[n.name] = n
                for a in n.attribute:
                    if a.type == a.GRAPH:
                        add(a.g)

        add(graph)

    def value(self, name: str) -> np.ndarray:
        """The float32 value of tensor `name` (an initializer, or a Cast/Mul/Add chain over initializers)."""
        if name in self._init:
            return self._init[name].astype(np.float32)
        node = self._producer.get(name)
        if node is None:
            raise ValueError(f"{name!r} is neither an initializer nor computed from initializers")
        if node.op_type == "Cast":
            return self.value(node.input[0])
        if node.op_type == "Mul":
            return self.value(node.input[0]) * self.value(node.input[1])
        if node.op_type == "Add":
            return self.value(node.input[0]) + self.value(node.input[1])
        raise ValueError(f"unexpected weight producer {node.op_type} for {name}")

    def input_of(self, node_name: str, index: int = 1) -> np.ndarray:
        """The value of input `index` of node `node_name`."""
        node = self._nodes.get(node_name)
        if node is None:
            raise ValueError(f"no node {node_name!r} in the packaged graph")
        return self.value(node.input[index])
