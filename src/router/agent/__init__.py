"""`router-agent`: runs beside an inference engine and exports what the GPU and the engine report."""
