"""ParameterServerStrategy over MPI: variables on ps ranks, functions scheduled on worker ranks by the chief."""
