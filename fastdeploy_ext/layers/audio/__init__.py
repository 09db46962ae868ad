"""MiDashengLM audio path: ``io`` (decode/resample, token count), ``frontend`` (log-mel), ``dasheng`` (encoder and
projector). Import the submodules directly; ``dasheng`` depends on the config package, which imports ``frontend``."""
