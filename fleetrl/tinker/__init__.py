"""The Tinker-compatible training API's domain: users write the loop, fleetrl runs the primitives.

Components (none imports HTTP; services/tinker wires them to the SDK's wire format and serves them):

- `types`: the requests' and results' values (datums, Adam parameters, sample parameters, results).
- `losses`: Tinker's built-in loss functions by name, on fleetrl's surrogates.
- `training`: `TrainingRun`, one LoRA adapter and its AdamW state (forward_backward, optim_step, state).
- `sampling`: `Samplers`, the actors' `HFBackend` over merged adapter versions.
- `fleet`: `FleetSampling` (sampler versions to the weight store, sample requests to the actors over
  `fleetrl.tasks.samples`) and `ActorSampling` (an actor's side; services/actor wires it).
- `checkpoints`: tinker:// checkpoint directories on disk, per tenant.
- `requests`: `RequestLog`, futures named by (scope, seq_id): a replayed request runs nothing twice.
- `service`: `TinkerService`, sessions, runs and samplers per tenant; it owns the others and is what
  services/tinker calls.
"""
