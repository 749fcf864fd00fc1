"""Models: loading from names, folders, built-in tasks or instances (`loading`), the actor-critic and the
response-grid forward (`actor_critic`), LoRA with the reference as adapters-off (`lora`), and building every
model a module needs (`build`)."""
