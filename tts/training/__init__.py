"""Training-side code for the flow-matching acoustic model: teacher data (hibari + the speech codec), the
resumable recipe and its evaluation gate.

Nothing at run time imports this package; `tts.flow_model` and `tts.flow_tts` stand alone.
"""
