"""Capture: the torch.compile backend, the pass manager, dumps and the report."""
from .backend import LOWERINGS, GrcompileBackend, GrcompileState
from ..passes.pass_manager import GraphPass, PassContext, PassResult, node_site, pass_name, run_pipeline
from .report import Report

__all__ = ["LOWERINGS", "GrcompileBackend", "GrcompileState", "GraphPass", "PassContext",
           "PassResult", "Report", "node_site", "pass_name", "run_pipeline"]
