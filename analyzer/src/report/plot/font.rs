//! The font every plot's text is measured and drawn with: DejaVu Sans,
//! embedded in the binary (licence: `analyzer/assets/fonts/LICENSE-DejaVu.txt`).
//! PNG text is rasterised here, and CI machines have no system fonts; SVG
//! text is drawn by the viewer, but its layout (legend width) is measured
//! with this font too.

use std::sync::OnceLock;

use plotters::style::{FontStyle, register_font};

/// The family name plots ask for; SVG viewers substitute their own sans-serif.
pub(super) const FAMILY: &str = "sans-serif";

pub(super) static DEJAVU_SANS: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

/// Registers the embedded font with plotters, once per process.
///
/// # Errors
/// When the embedded bytes do not parse as a font (a broken build).
pub(super) fn ensure_registered() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            register_font(FAMILY, FontStyle::Normal, DEJAVU_SANS)
                .map_err(|_| "the embedded DejaVu Sans does not parse as a font".to_owned())
        })
        .clone()
}
