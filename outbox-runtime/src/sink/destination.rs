//! Where a sink publishes an event, as OpenTelemetry's messaging conventions name it.

/// Where a sink publishes an event: the messaging system (`messaging.system`: `kafka`,
/// `nats`, `rabbitmq`) and the destination's name there (`messaging.destination.name`: a
/// topic, a subject, an exchange), with any attribute the system's own conventions add.
/// The relay's `send` span of a traced event says it (feature `otel`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    system: &'static str,
    name: String,
    attributes: Vec<(&'static str, String)>,
}

impl Destination {
    /// `name` on `system`.
    pub fn new(system: &'static str, name: impl Into<String>) -> Self {
        Self {
            system,
            name: name.into(),
            attributes: Vec::new(),
        }
    }

    /// With one more attribute of the system's conventions (RabbitMQ's
    /// `messaging.rabbitmq.destination.routing_key`, say).
    #[must_use]
    pub fn with_attribute(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.attributes.push((key, value.into()));
        self
    }

    /// The messaging system.
    pub fn system(&self) -> &'static str {
        self.system
    }

    /// The destination's name on it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The system, the name and the system's own attributes, taken.
    #[cfg(feature = "otel")]
    pub(crate) fn into_parts(self) -> (&'static str, String, Vec<(&'static str, String)>) {
        (self.system, self.name, self.attributes)
    }

    /// The system's own attributes.
    pub fn attributes(&self) -> &[(&'static str, String)] {
        &self.attributes
    }
}
